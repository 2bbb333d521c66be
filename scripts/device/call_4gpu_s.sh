#!/usr/bin/env bash
# 4 GPUs, tenth session, issue 14: dpp against dpp-zb with CUDA graphs, now that dpp-zb's stage 0 runs
# whole backwards at v=1 (DynamicOptions.split_first_stage: no W buffers on the stage that sets peak
# memory) -- at equal recompute (2 recomputing slots on stage 0; none), beside megatron-core's best
# 1F1B; scenario (a) uniform.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 90 --rounds 1"
mkdir -p "$OUT/a"
echo "=== (a) uniform"
timeout 300 python3 -m trainer.bench.pipeline --out /tmp/bench-sa --report "$OUT/a/benchmarks-s-a.md" --scenarios a $B \
    --lines megatron-1f1b-best,dpp-graphs-rs2,dpp-zb-graphs-rs2,dpp-graphs,dpp-zb-graphs 2>&1 | grep "^\[bench\]"
