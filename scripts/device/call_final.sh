#!/usr/bin/env bash
# Final benchmark call: scenarios a/b/c (uniform, variable lengths, transient stalls) for megatron-core's
# best 1F1B, dpp and dpp-zb; then a GPU-bound variant (mbs 8) of (a); then a short same-node bench.
# 4 GPUs: the issue-12 model (GPT 16L, PP=4, M=32); 2 GPUs: GPT 8L, PP=2, M=16 (same widths).
set -u
source scripts/device/env.sh || exit 1
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -ge 4 ]; then SHAPE="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32"
else SHAPE="--pipeline-parallel 2 --num-layers 8 --num-microbatches 16"; fi
LINES=megatron-1f1b-best,dpp,dpp-zb
timeout 420 python3 -m trainer.bench.pipeline --out /tmp/bench --report "$OUT/benchmarks.md" --scenarios a,b,c \
    $SHAPE --train-iters 12 --line-timeout 80 --threads 4 --lines $LINES 2>&1 | grep "^\[bench\]"
timeout 150 python3 -m trainer.bench.pipeline --out /tmp/bench-mbs8 --report "$OUT/benchmarks-mbs8.md" --scenarios a \
    $SHAPE --micro-batch-size 8 --train-iters 10 --line-timeout 70 --threads 4 --lines $LINES 2>&1 | grep "^\[bench\]"
timeout 60 python3 -m trainer.transport.bench --device cuda --transports shm --sizes 64K,8M --repeats 10 --no-busy 2>&1 \
    | grep -E "^ +[0-9]|^#"
rm -f "$OUT"/*.png; cp /tmp/bench/timeline-b-*.png /tmp/bench/timeline-a-dpp-zb.png "$OUT"/ 2>/dev/null; ls "$OUT"
