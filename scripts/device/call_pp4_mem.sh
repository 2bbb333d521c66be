#!/usr/bin/env bash
# 4 GPUs, issue-12 model, one round: peak *reserved* memory (what a graphed run really holds) of
# megatron-core's best 1F1B against DPP with graphs at 1F1B caps and with cap factors 1.25 / 1.5,
# after the shared backward pool; scenario (b) for the 1.25 line.
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 80"
timeout 330 python3 -m trainer.bench.pipeline --out /tmp/bench-mem --report "$OUT/benchmarks-mem.md" --scenarios a \
    $B --lines megatron-1f1b-best,dpp-graphs,dpp-graphs-cf1.25,dpp-graphs-cf1.5 2>&1 | grep "^\[bench\]"
grep -h "reserved for them" /tmp/bench-mem/a-dpp-graphs*/*.log 2>/dev/null | sed 's/.*INFO//' | sort -u
rm -f "$OUT"/timeline-*.png; ls "$OUT"
