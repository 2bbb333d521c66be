#!/usr/bin/env bash
# 4 GPUs, issue-12 model (GPT 16L h2048 seq 1024 mbs 2, PP=4, M=32), after the slot-pool capture
# (weight gradients accumulated inside the backward graph, one graph pair per bucket length).
#   scripts/device/call_pp4_s4.sh a   scenario (a), 2 interleaved rounds: cap factors 1.5/2 and v=2 vs megatron-core
#   scripts/device/call_pp4_s4.sh b   scenario (b) variable lengths (lognormal 0.6, buckets of 128), 2 rounds
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --threads 4 --rounds 2"
case "${1:-a}" in
a) timeout 560 python3 -m trainer.bench.pipeline --out /tmp/bench-s4a --report "$OUT/benchmarks-s4a.md" --scenarios a \
       $B --line-timeout 80 \
       --lines megatron-1f1b-best,megatron-interleaved-v2,dpp-graphs-cf1.5,dpp-graphs-cf2,dpp-graphs-v2,dpp-graphs-v2-cf1.25 \
       2>&1 | grep "^\[bench\]"
   grep -h "CUDA graphs for" /tmp/bench-s4a/a-dpp-graphs-cf2*/*.log 2>/dev/null | sort -u | head -4
   rm -f "$OUT"/timeline-a-megatron-interleaved*.png "$OUT"/timeline-a-dpp-graphs-v2.png ;;
b) timeout 560 python3 -m trainer.bench.pipeline --out /tmp/bench-s4b --report "$OUT/benchmarks-s4b.md" --scenarios b \
       $B --line-timeout 110 --seq-length-divisible-by 128 \
       --lines megatron-1f1b-best,megatron-interleaved-v2,dpp-graphs-cf1.5,dpp-graphs-v2 \
       2>&1 | grep "^\[bench\]"
   grep -h "CUDA graphs for" /tmp/bench-s4b/b-dpp-graphs-cf1.5*/*.log 2>/dev/null | sort -u | head -4
   rm -f "$OUT"/timeline-b-megatron-interleaved*.png ;;
esac
ls "$OUT"
