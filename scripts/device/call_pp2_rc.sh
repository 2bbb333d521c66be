#!/usr/bin/env bash
# 2 GPUs, 2 interleaved rounds: speed and peak *reserved* memory of megatron-core's best 1F1B against DPP
# with graphs and selective recompute (--recompute-activations) at 1F1B caps and --dpp-cap-factor 1.5,
# GPT 8 layers (balanced 5/3), PP=2, M=16 (the configuration of call_pp2_mem.sh).
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 2 --num-layers 8 --num-microbatches 16 --train-iters 8 --threads 4 --line-timeout 70"
timeout 420 python3 -m trainer.bench.pipeline --out /tmp/bench-rc2 --report "$OUT/benchmarks-pp2-rc.md" \
    --scenarios a $B --rounds 2 --lines megatron-1f1b-best,dpp-graphs-rc,dpp-graphs-rc-cf1.5 2>&1 | grep "^\[bench\]"
grep -h "reserved for them" /tmp/bench-rc2/*-dpp-graphs*/*.log 2>/dev/null | sed 's/.*INFO//' | sort -u
rm -f "$OUT"/timeline-*.png; ls "$OUT"
