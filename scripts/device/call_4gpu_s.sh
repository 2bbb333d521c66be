#!/usr/bin/env bash
# 4 GPUs, tenth session, issue 14: the head-to-head call r left open -- dpp and dpp-zb with CUDA graphs
# and no recompute (call r compared dpp with 2 recomputing slots on stage 0 against dpp-zb without),
# beside megatron-core's best 1F1B; scenario (a) uniform.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 90 --rounds 1"
mkdir -p "$OUT/a"
echo "=== (a) uniform"
timeout 260 python3 -m trainer.bench.pipeline --out /tmp/bench-sa --report "$OUT/a/benchmarks-s-a.md" --scenarios a $B \
    --lines megatron-1f1b-best,dpp-graphs,dpp-zb-graphs 2>&1 | grep "^\[bench\]"
