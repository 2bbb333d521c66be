#!/usr/bin/env bash
# 4 GPUs: the multi-GPU test files (same-node and NCCL transport, the 2+2 NCCL split training, GPU spans)
# and tests/dist/test_train_gpu.py (first 10 losses of dpp, dpp-zb and graphs+recompute+cf1.5 against
# megatron-core's 1F1B), each file bounded; logs under $OUT.
#   scripts/device/call_4gpu_tests.sh [SECONDS_PER_FILE] [TEST_FILE ...]
set -u
source scripts/device/env.sh || exit 1
per=${1:-240}; shift || true
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/gpu/test_transport_gpu.py tests/gpu/test_transport_nccl_gpu.py
                                 tests/gpu/test_dpp_nccl_split.py tests/gpu/test_gpu_spans.py tests/dist/test_train_gpu.py)
for t in "${files[@]}"; do
    gpu_pytest "$t" "$per" "^ *[0-9]+ |iteration|passed|failed|Error|assert|skipped" 16
done
