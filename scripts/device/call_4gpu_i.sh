#!/usr/bin/env bash
# 4 GPUs, a short last call (~3 min): the launch probe, then megatron-core's best 1F1B, the candidate
# (dpp-graphs-rs2-q1) and megatron-core driven directly (issue 12's goal 1), one round, scenario (a).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
timeout 150 python3 -m trainer.bench.pipeline --out /tmp/bench-i --report "$OUT/benchmarks-i.md" --scenarios a \
    --pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 60 \
    --rounds 1 --lines megatron-1f1b-best,dpp-graphs-rs2-q1,direct-megatron 2>&1 | grep "^\[bench\]"
