#!/usr/bin/env bash
# Short 4-GPU check (little device time left): dpp-graphs (every stage's block graphed) vs megatron-core's
# best 1F1B, scenario (a), one round of 10 iterations. The [bench] lines print as each run ends.
set -u
source scripts/device/env.sh || exit 1
timeout 150 python3 -m trainer.bench.pipeline --out /tmp/bench-q --report "$OUT/benchmarks-quick.md" --scenarios a \
    --pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --line-timeout 70 --threads 4 \
    --lines dpp-graphs,megatron-1f1b-best 2>&1 | grep "^\[bench\]"
rm -f "$OUT"/*.png
