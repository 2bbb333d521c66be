#!/usr/bin/env bash
# 4 GPUs, issue-12 model, one round, short: (a) peak *reserved* memory (what a graphed run really holds)
# of megatron-core's best 1F1B against DPP with graphs and --dpp-cap-factor 1.5 (shared backward pool);
# (d) the sample corpus's real document lengths (issue 13). The 1F1B-caps figure follows by subtracting
# the extra slots (the set-up log prints each stage's graph pools).
set -u
source scripts/device/env.sh || exit 1
source scripts/device/corpus.sh
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 8 --threads 4 --line-timeout 70"
timeout 185 python3 -m trainer.bench.pipeline --out /tmp/bench-mem --report "$OUT/benchmarks-mem.md" --scenarios a,d \
    $B --corpus "$CORPUS" --lines megatron-1f1b-best,dpp-graphs-cf1.5 2>&1 | grep "^\[bench\]"
grep -h "reserved for them" /tmp/bench-mem/*-dpp-graphs*/*.log 2>/dev/null | sed 's/.*INFO//' | sort -u
rm -f "$OUT"/timeline-a-*.png; ls "$OUT"
