#!/usr/bin/env bash
# One GPU: run the named GPU test files (default: megatron-core checkpoints on CUDA and the two
# CUDA-graph equivalence tests), each bounded, keeping their logs under $OUT.
#   scripts/device/call_gpu_tests_1gpu.sh SECONDS_PER_FILE [TEST_FILE ...]
set -u
source scripts/device/env.sh || exit 1
per=${1:-280}; shift || true
files=("$@"); [ ${#files[@]} -gt 0 ] || files=(tests/gpu/test_checkpoint_gpu.py tests/gpu/test_dpp_cuda_graphs.py tests/gpu/test_megatron_cuda_graphs.py)
for t in "${files[@]}"; do
    echo "=== $t"
    timeout "$per" python3 -m pytest -x -q -s -m gpu -p no:cacheprovider "$t" > /tmp/t.log 2>&1; echo "rc=$?"
    grep -vE "UserWarning|warnings.warn|^$" /tmp/t.log | grep -E "same|one-rank|replayed|passed|failed|Error|assert|skipped" | tail -15
    cp /tmp/t.log "$OUT/$(basename "$t" .py).log"
done
