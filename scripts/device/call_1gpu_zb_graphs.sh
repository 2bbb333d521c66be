#!/usr/bin/env bash
# 1 GPU, tenth session, issue 14: --dpp-cuda-graphs with --dpp-policy dpp-zb (F, I and W graphs per
# slot) against eager dpp-zb -- the zb cases of tests/gpu/test_dpp_cuda_graphs.py (two ranks share the
# GPU over gloo), plus the plain v1 case (the non-split graphs must not have moved).
set -u
source scripts/device/env.sh || exit 1
timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_dpp_cuda_graphs.py \
    -k "zb or (v1-recompute-slot and not zb)" -x -s > "$OUT/tests-zb-graphs.log" 2>&1; echo "tests rc=$?"
grep -h "replayed/eager\|passed\|failed\|Error\|error" "$OUT/tests-zb-graphs.log" | tail -20
