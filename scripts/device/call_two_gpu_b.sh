#!/usr/bin/env bash
# 2-GPU device call: GPU tier (flags and events signalling), same-node bench with both signals,
# PP=2 pipeline benchmark incl. dpp-zb, and traced DPP runs whose summary has per-op GPU busy/idle.
set -u
source scripts/device/env.sh || exit 1
timeout 200 python3 -m pytest -m gpu tests/gpu -v -x -p no:cacheprovider 2>&1 | grep -E "PASS|FAIL|SKIP|Error|passed|failed" | head -n 20
for sig in flags events; do
  echo "== shm bench, gpu signals: $sig"
  timeout 120 python3 -m trainer.transport.bench --device cuda --transports shm --sizes 64K,1M,8M,64M,256M \
      --repeats 10 --gpu-signals $sig --json "$OUT/bench-shm-$sig.json" 2>&1 | grep -E "^ +[0-9]|^#|size"
done
M8="--device cuda --mock-data --num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 \
  --max-position-embeddings 1024 --vocab-size 50257 --micro-batch-size 2 --global-batch-size 32 \
  --pipeline-model-parallel-size 2 --bf16 --optimizer sgd --lr 1e-4 --hidden-dropout 0 --attention-dropout 0 \
  --seed 1234 --log-interval 1 --decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 3"
for pol in dpp dpp-zb; do
  rm -rf /tmp/prof-$pol
  timeout 120 torchrun --standalone --nproc-per-node 2 -m trainer.train $M8 --train-iters 6 --use-dpp \
      --dpp-policy $pol --profile-dir /tmp/prof-$pol > "$OUT/traced-$pol.log" 2>&1; echo "traced $pol exit $?"
  grep -E "iteration +[0-9]+/" "$OUT/traced-$pol.log" | tail -n 3 | cut -c1-160
  timeout 60 python3 -m trainer.profiling.aggregate --benchmark_dir /tmp/prof-$pol --iteration 4 \
      --png "$OUT/timeline-$pol.png" 2>&1 | tail -n 9
done
timeout 300 python3 -m trainer.bench.pipeline --out /tmp/bench --report /tmp/bench/benchmarks.md --scenarios a \
    --pipeline-parallel 2 --num-layers 8 --num-microbatches 16 --train-iters 12 --line-timeout 90 --threads 4 \
    --lines megatron-1f1b-best,dpp,dpp-zb,direct-megatron 2>&1 | grep "^\[bench\]"
cp /tmp/bench/benchmarks.md "$OUT/benchmarks-pp2.md" 2>/dev/null
