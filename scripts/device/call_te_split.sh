#!/usr/bin/env bash
# 2 GPUs (or 1, both ranks sharing it over gloo), Transformer Engine's layers (the wheel scripts/te/build.sh
# made, carried in .te/wheel): split backward (dpp-zb, eager and from the slot graphs) with TE's deferred weight
# GEMMs against megatron-core's 1F1B and the unsplit DPP runtime, fp32 and bf16 (tests/gpu/test_te_split_gpu.py); then,
# in the time left, the TE test of the unsplit paths (tests/gpu/test_te_gpu.py). Every step bounded.
#   run(command="bash scripts/device/call_te_split.sh", kind="nvidia-h200-x2", carry=[".whl", ".te/whl", ".te/wheel"])
set -u
BUDGET=${TE_CALL_BUDGET_S:-540}
start=$SECONDS
source scripts/device/env.sh || exit 1
source scripts/te/install.sh || exit 1
left() { echo $((BUDGET - (SECONDS - start))); }

gpu_pytest tests/gpu/test_te_split_gpu.py 480 "^[0-9]+ |installed|deferred|replayed|gradient tensors|passed|failed|Error|assert|skipped" 40
if [ "$(left)" -gt 200 ]; then
    gpu_pytest tests/gpu/test_te_gpu.py $(( $(left) - 10 )) "^[0-9]+ |passed|failed|Error|assert" 12
fi
echo "all in $((SECONDS - start)) s"
