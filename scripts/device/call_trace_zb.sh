#!/usr/bin/env bash
# Traced dpp and dpp-zb at PP=2, mbs 8 (GPU-bound): per-op host and GPU spans, summary, timeline PNGs.
set -u
source scripts/device/env.sh || exit 1
M8="--device cuda --mock-data --num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 \
  --max-position-embeddings 1024 --vocab-size 50257 --micro-batch-size 8 --global-batch-size 128 \
  --pipeline-model-parallel-size 2 --bf16 --optimizer sgd --lr 1e-4 --hidden-dropout 0 --attention-dropout 0 \
  --seed 1234 --log-interval 1 --decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 3"
for pol in dpp-zb dpp; do
  timeout 70 torchrun --standalone --nproc-per-node 2 -m trainer.train $M8 --train-iters 5 --use-dpp --dpp-eager \
      --dpp-policy $pol --profile-dir /tmp/prof-$pol > /tmp/$pol.log 2>&1; echo "traced $pol exit $?"
  timeout 40 python3 -m trainer.profiling.aggregate --benchmark_dir /tmp/prof-$pol --iteration 3 \
      --png "$OUT/timeline-mbs8-$pol.png" 2>&1 | tail -n 8
  cp /tmp/prof-$pol/summary.json "$OUT/summary-mbs8-$pol.json" 2>/dev/null
done
