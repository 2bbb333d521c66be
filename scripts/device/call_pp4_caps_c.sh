#!/usr/bin/env bash
# 4 GPUs, issue-12 model, scenario (c) transient stalls (rank 1, 5% of ops, 20 ms, seed 1234, the same for
# every line): megatron-core 1F1B (best configuration) and interleaved v=2 against DPP with graphs and
# --dpp-cap-factor 1.5.
set -u
source scripts/device/env.sh || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --line-timeout 80 --threads 4"
timeout 240 python3 -m trainer.bench.pipeline --out /tmp/bench-cc --report "$OUT/benchmarks-caps-c.md" --scenarios c \
    $B --lines megatron-1f1b-best,megatron-interleaved-v2,dpp-graphs-cf1.5 2>&1 | grep "^\[bench\]"
rm -f "$OUT"/*.png; ls "$OUT"
