#!/usr/bin/env bash
# 4 GPUs, issue-12 model, scenario (a), 2 interleaved rounds: DPP with CUDA graphs at 1F1B's caps and with
# headroom on the early stages (--dpp-cap-factor 1.25: 5/3/2/1, 1.5: 6/4/3/1) and at v=2, against
# megatron-core's 1F1B (best configuration) and interleaved v=2.
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --line-timeout 80 --threads 4"
timeout 540 python3 -m trainer.bench.pipeline --out /tmp/bench-caps --report "$OUT/benchmarks-caps.md" --scenarios a \
    $B --rounds 2 --lines megatron-1f1b-best,megatron-interleaved-v2,dpp-graphs,dpp-graphs-cf1.25,dpp-graphs-cf1.5,dpp-graphs-v2 \
    2>&1 | grep "^\[bench\]"
grep -h "CUDA graphs for" /tmp/bench-caps/a-dpp-graphs-cf1.5/*.log 2>/dev/null | head -4
rm -f "$OUT"/timeline-a-megatron-interleaved*.png "$OUT"/timeline-a-dpp-graphs-cf1.25.png; ls "$OUT"
