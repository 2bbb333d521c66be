#!/usr/bin/env bash
# One GPU: --cuda-graph-impl local (megatron-core's per-layer graphs) equals eager megatron-core (PP=1 here;
# PP=2 runs where 2+ GPUs are).
set -u
source scripts/device/env.sh || exit 1
timeout 560 python3 -m pytest -x -q -s -m gpu -p no:cacheprovider tests/gpu/test_megatron_cuda_graphs.py 2>&1 \
    | grep -vE "UserWarning|warnings.warn|^$" | grep -E "graphs created|iteration|^[0-9]|passed|failed|skipped|Error|error|assert|Traceback|File " | tail -40
