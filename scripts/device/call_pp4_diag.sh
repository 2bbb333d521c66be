#!/usr/bin/env bash
# 4-GPU diagnosis of scenario (a): a traced dpp run (host and GPU spans per op, iteration 4 drawn),
# then megatron-core's best 1F1B and dpp interleaved over 2 rounds with their kernel timelines.
set -u
source scripts/device/env.sh || exit 1
source scripts/device/gpt16.sh
# The bench's configuration: SGD without warm-up, the balanced 5/4/4/3 split (later flags win).
G16="$GPT16 --optimizer sgd --lr-warmup-iters 0 --decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 3"
timeout 90 torchrun --standalone --nproc-per-node 4 -m trainer.train $G16 --train-iters 6 --use-dpp --dpp-eager \
    --dpp-policy dpp --profile-dir /tmp/prof-dpp > /tmp/dpp.log 2>&1; echo "traced dpp exit $?"; grep -E "iteration +[3-6]" /tmp/dpp.log | tail -3
timeout 60 python3 -m trainer.profiling.aggregate --benchmark_dir /tmp/prof-dpp --iteration 4 \
    --png /tmp/timeline-traced-dpp.png 2>&1 | tail -n 12
cp /tmp/prof-dpp/summary.json "$OUT/summary-traced-dpp.json" 2>/dev/null
timeout 300 python3 -m trainer.bench.pipeline --out /tmp/bench --report "$OUT/benchmarks-diag.md" --scenarios a \
    --pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --line-timeout 70 --threads 4 \
    --rounds 2 --lines megatron-1f1b-best,dpp 2>&1 | grep "^\[bench\]"
cp /tmp/timeline-traced-dpp.png "$OUT"/; ls "$OUT"
