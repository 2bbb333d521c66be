#!/usr/bin/env bash
# 4 GPUs: issue 12's goal 1 -- the trainer's megatron-core 1F1B (best configuration) against megatron-core
# driven directly (trainer.bench.direct), 4 interleaved rounds in one call; then the 4-GPU test files
# (2+2 NCCL split training, GPU spans).
set -u
here=$(dirname "$0")
source scripts/device/env.sh >/dev/null || exit 1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 380 python3 -m trainer.bench.pipeline --out /tmp/bench-g1 --report "$OUT/benchmarks-goal1.md" \
    --scenarios a $B --rounds 4 --lines megatron-1f1b-best,direct-megatron 2>&1 | grep "^\[bench\]"
bash "$here/call_4gpu_tests.sh" 110 tests/gpu/test_dpp_nccl_split.py tests/gpu/test_gpu_spans.py
