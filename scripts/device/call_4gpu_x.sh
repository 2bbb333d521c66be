#!/usr/bin/env bash
# 4 GPUs, eleventh session, issue 14: eager (no CUDA graphs) dpp against dpp-zb with fill_transit, at
# v=1 and v=2, beside megatron-core's best 1F1B -- the evidence for the runtime's default policy
# without --dpp-cuda-graphs (call w measured the graphed lines).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 90 --rounds 1"
mkdir -p "$OUT/a"
timeout 400 python3 -m trainer.bench.pipeline --out /tmp/bench-xa --report "$OUT/a/benchmarks-x-a.md" --scenarios a $B \
    --lines megatron-1f1b-best,dpp,dpp-zb,dpp-v2,dpp-zb-v2 2>&1 | grep "^\[bench\]"
