#!/usr/bin/env bash
# Not run on a GPU yet: the GPU spans test and the landed test, then traces that say why dpp-zb's slow
# iterations are slow.
# 1. on GPUs 0,1: tests/gpu/test_gpu_spans.py (an op's GPU span opens after its input was produced:
#    the runtime now queues the payload wait before the span's start event) and the landed test;
# 2. scripts/device/call_4gpu_u.sh: traced graphed dpp-zb and dpp on the benchmark model (4 GPUs) or
#    its 8-layer PP=2 cut (2 GPUs), each iteration's critical path with what each host did in the path's
#    one-stage gaps (launch / send / wait / run-ahead / landed / decide / untraced) and the runs'
#    end-of-run "looked ... whether gradients had landed" lines; the same dpp-zb run again with
#    --manual-gc (the traces now hold every garbage collection as a "gc" span). Each aggregation also
#    prints the run's stage balance: the first GPU check of that fit.
set -u
source scripts/device/env.sh >/dev/null || exit 1
CUDA_VISIBLE_DEVICES=0,1 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
    tests/gpu/test_gpu_spans.py \
    "tests/gpu/test_transport_gpu.py::test_landed_says_no_until_the_payload_is_on_the_gpu" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|assert|Error" | head -20
# the third run: dpp-zb with Megatron-LM's --manual-gc (no automatic collection inside a step); the
# traces' gc spans say whether automatic gen-2 collections are the slow iterations' host gaps
bash scripts/device/call_4gpu_u.sh --manual-gc --manual-gc-interval 0
grep -h "whether gradients had landed" "$OUT"/*.log | head -8
grep -h "garbage collection(s) ran inside training steps" "$OUT"/*.log | head -12
true
