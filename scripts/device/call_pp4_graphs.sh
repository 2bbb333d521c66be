#!/usr/bin/env bash
# 4 GPUs, issue-12 model: megatron-core's best 1F1B vs dpp vs dpp + CUDA graphs; scenario (a) over
# 2 interleaved rounds, scenario (c) once.
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --line-timeout 80 --threads 4"
timeout 330 python3 -m trainer.bench.pipeline --out /tmp/bench-a --report "$OUT/benchmarks-a.md" --scenarios a \
    $B --rounds 2 --lines megatron-1f1b-best,dpp,dpp-graphs 2>&1 | grep "^\[bench\]"
timeout 200 python3 -m trainer.bench.pipeline --out /tmp/bench-c --report "$OUT/benchmarks-c.md" --scenarios c \
    $B --lines megatron-1f1b-best,dpp,dpp-graphs 2>&1 | grep "^\[bench\]"
rm -f "$OUT"/timeline-a-megatron*.png "$OUT"/timeline-c-*.png; grep -h "CUDA graphs\|replayed" /tmp/bench-a/*/*.log 2>/dev/null | head -4
ls "$OUT"
