#!/usr/bin/env bash
# 2-GPU check of the deferred payload wait: GPU tier, then megatron-core 1F1B (best) vs dpp vs dpp-zb at
# PP=2 on the GPU-bound mbs 8 model and on mbs 2 (scenario a).
set -u
source scripts/device/env.sh || exit 1
timeout 120 python3 -m pytest -m gpu tests/gpu -x -q -p no:cacheprovider 2>&1 | tail -n 2
SHAPE="--pipeline-parallel 2 --num-layers 8 --num-microbatches 16"
for mbs in 8 2; do
  timeout 170 python3 -m trainer.bench.pipeline --out /tmp/bench-$mbs --report "$OUT/benchmarks-mbs$mbs.md" \
      --scenarios a $SHAPE --micro-batch-size $mbs --train-iters 10 --line-timeout 60 --threads 4 \
      --lines megatron-1f1b-best,dpp,dpp-zb 2>&1 | grep "^\[bench\]"
done
rm -f "$OUT"/*.png; cp /tmp/bench-8/../bench-8/*/metrics_rank00000.json /dev/null 2>&1; ls "$OUT"
