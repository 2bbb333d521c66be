#!/usr/bin/env bash
# One GPU: --dpp-cuda-graphs equals eager DPP (two ranks sharing the GPU over gloo): losses and gradients.
set -u
source scripts/device/env.sh || exit 1
timeout 560 python3 -m pytest -x -q -s -m gpu -p no:cacheprovider tests/gpu/test_dpp_cuda_graphs.py 2>&1 \
    | grep -vE "UserWarning|warnings.warn|^$" | grep -E "replayed|iteration|^[0-9]|passed|failed|Error|assert" | tail -30
