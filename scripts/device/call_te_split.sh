#!/usr/bin/env bash
# 2 GPUs (or 1, both ranks sharing it over gloo), Transformer Engine's layers (the wheel scripts/te/build.sh
# made, carried in .te/wheel): split backward (dpp-zb, eager) with TE's deferred weight GEMMs against
# megatron-core's 1F1B and the unsplit DPP runtime, fp32 and bf16 (tests/gpu/test_te_split_gpu.py); then,
# in the time left, the TE test of the unsplit paths (tests/gpu/test_te_gpu.py). Every step bounded.
#   run(command="bash scripts/device/call_te_split.sh", kind="nvidia-h200-x2", carry=[".whl", ".te/whl", ".te/wheel"])
set -u
BUDGET=${TE_CALL_BUDGET_S:-540}
start=$SECONDS
source scripts/device/env.sh || exit 1
source scripts/te/install.sh || exit 1
left() { echo $((BUDGET - (SECONDS - start))); }

t0=$SECONDS
timeout 420 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_te_split_gpu.py > "$OUT/test_te_split_gpu.log" 2>&1
echo "== test_te_split_gpu: rc=$? in $((SECONDS - t0)) s"
grep -vE "UserWarning|warnings.warn" "$OUT/test_te_split_gpu.log" \
    | grep -E "^[0-9]+ |installed|deferred|gradient tensors|passed|failed|Error|assert|skipped" | tail -30
if [ "$(left)" -gt 200 ]; then
    t0=$SECONDS
    timeout $(( $(left) - 10 )) python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_te_gpu.py \
        > "$OUT/test_te_gpu.log" 2>&1
    echo "== test_te_gpu: rc=$? in $((SECONDS - t0)) s"
    grep -vE "UserWarning|warnings.warn" "$OUT/test_te_gpu.log" | grep -E "^[0-9]+ |passed|failed|Error|assert" | tail -12
fi
echo "all in $((SECONDS - start)) s"
