#!/usr/bin/env bash
# 4 GPUs, issue-12 model, scenario (a), 2 interleaved rounds (NOT yet run): the simulator's recommended caps
# for the measured per-hop latency (docs/schedules.md: dpp at 1.75-2x) against 1.5x and megatron-core's
# best lines; peak memory must stay <= 1.10x megatron's (11.28 GiB on 4xH100).
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --line-timeout 80 --threads 4"
timeout 540 python3 -m trainer.bench.pipeline --out /tmp/bench-caps2 --report "$OUT/benchmarks-caps2.md" --scenarios a \
    $B --rounds 2 --lines megatron-1f1b-best,megatron-interleaved-v2,dpp-graphs-cf1.5,dpp-graphs-cf1.75,dpp-graphs-cf2 \
    2>&1 | grep "^\[bench\]"
rm -f "$OUT"/timeline-a-megatron*.png "$OUT"/timeline-a-dpp-graphs-cf1.5.png; ls "$OUT"
