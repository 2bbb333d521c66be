#!/usr/bin/env bash
# 4 GPUs, issue-12 model: scenario (a), 2 interleaved rounds: megatron 1F1B eager and with megatron-core's
# own CUDA graphs, DPP with graphs, and megatron-core driven directly (the trainer's overhead); then
# scenario (c) transient stalls for the three trainer lines.
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --line-timeout 80 --threads 4"
timeout 380 python3 -m trainer.bench.pipeline --out /tmp/bench-a2 --report "$OUT/benchmarks-a2.md" --scenarios a \
    $B --rounds 2 --lines megatron-1f1b-best,megatron-1f1b-graphs,dpp-graphs,direct-megatron 2>&1 | grep "^\[bench\]"
grep -h "megatron-core CUDA graphs\|Error" /tmp/bench-a2/*graphs*/*.log 2>/dev/null | sort | uniq -c | head -8
timeout 190 python3 -m trainer.bench.pipeline --out /tmp/bench-c --report "$OUT/benchmarks-c.md" --scenarios c \
    $B --lines megatron-1f1b-best,megatron-1f1b-graphs,dpp-graphs 2>&1 | grep "^\[bench\]"
rm -f "$OUT"/timeline-c-*.png "$OUT"/timeline-a-megatron-1f1b-best*.png "$OUT"/timeline-a-dpp*.png "$OUT"/timeline-a-direct*.png; ls "$OUT"
