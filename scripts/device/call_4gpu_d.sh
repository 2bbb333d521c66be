#!/usr/bin/env bash
# 4 GPUs, scenario (a), 2 rounds: every megatron-core line a user would pick (1F1B best, interleaved
# v=2) against DPP with graphs at 1F1B caps (v=1, v=2) and with recompute at cap factor 1.5; first a
# probe of how fast this host launches kernels (the eager megatron lines are launch-bound on slow hosts).
set -u
source scripts/device/env.sh >/dev/null || exit 1
lscpu | grep -E "^(Model name|CPU MHz|CPU\(s\))"; python3 -m trainer.bench.launch_probe
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 440 python3 -m trainer.bench.pipeline --out /tmp/bench-d --report "$OUT/benchmarks-all.md" \
    --scenarios a $B --rounds 2 \
    --lines megatron-1f1b-best,megatron-interleaved-v2,dpp-graphs,dpp-graphs-v2,dpp-graphs-rc-cf1.5 2>&1 | grep "^\[bench\]"
python3 -m trainer.bench.launch_probe
