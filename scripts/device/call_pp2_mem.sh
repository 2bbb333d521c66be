#!/usr/bin/env bash
# 2 GPUs (when no 4-GPU kind is lent), one round: peak *reserved* memory of megatron-core's best 1F1B
# against DPP with graphs at 1F1B caps and --dpp-cap-factor 1.5, GPT 8 layers (balanced 5/3), PP=2, M=16;
# (d) the same two DPP/megatron lines on the sample corpus's real document lengths.
set -u
source scripts/device/env.sh || exit 1
source scripts/device/corpus.sh
B="--pipeline-parallel 2 --num-layers 8 --num-microbatches 16 --train-iters 8 --threads 4 --line-timeout 60"
timeout 95 python3 -m trainer.bench.pipeline --out /tmp/bench-mem2 --report "$OUT/benchmarks-pp2-mem.md" \
    --scenarios a $B --lines megatron-1f1b-best,dpp-graphs,dpp-graphs-cf1.5 2>&1 | grep "^\[bench\]"
timeout 65 python3 -m trainer.bench.pipeline --out /tmp/bench-mem2 --report "$OUT/benchmarks-pp2-d.md" \
    --scenarios d $B --corpus "$CORPUS" --lines megatron-1f1b-best,dpp-graphs-cf1.5 \
    2>&1 | grep "^\[bench\]"
grep -h "reserved for them" /tmp/bench-mem2/*-dpp-graphs*/*.log 2>/dev/null | sed 's/.*INFO//' | sort -u
rm -f "$OUT"/timeline-*.png; ls "$OUT"
