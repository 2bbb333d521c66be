#!/usr/bin/env bash
# 4 GPUs, issue-12 model, scenario (a), 2 interleaved rounds: every megatron-core line a user could pick
# (1F1B best, 1F1B with megatron-core's own CUDA graphs, interleaved v=2) against DPP with CUDA graphs at
# v=1 and v=2. The [bench] lines print as each run ends.
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --line-timeout 80 --threads 4"
timeout 560 python3 -m trainer.bench.pipeline --out /tmp/bench-a --report "$OUT/benchmarks-a.md" --scenarios a \
    $B --rounds 2 --lines megatron-1f1b-best,megatron-1f1b-graphs,megatron-interleaved-v2,dpp-graphs,dpp-graphs-v2 \
    2>&1 | grep "^\[bench\]"
grep -h "CUDA graphs\|replayed" /tmp/bench-a/*/*.log 2>/dev/null | sort | uniq -c | head -12
rm -f "$OUT"/timeline-a-megatron-interleaved*.png "$OUT"/timeline-a-megatron-1f1b-best*.png
ls "$OUT"
