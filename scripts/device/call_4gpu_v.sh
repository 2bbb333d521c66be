#!/usr/bin/env bash
# 4 GPUs, eleventh session, issue 14: dpp-zb told which gradients have landed (fill_transit).
# 1. the GPU tests of StageLinks.landed (same-node flags/events, NCCL) on GPUs 0,1;
# 2. traced runs of the issue-12 model (scripts/device/call_4gpu_u.sh): graphed dpp-zb (fill_transit,
#    the new default), graphed dpp, and graphed dpp-zb --no-dpp-fill-transit (the old behaviour), each
#    with the critical path of every iteration.
set -u
source scripts/device/env.sh >/dev/null || exit 1
CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
    "tests/gpu/test_transport_gpu.py::test_landed_says_no_until_the_payload_is_on_the_gpu" 2>&1 | tail -n 4
bash scripts/device/call_4gpu_u.sh --no-dpp-fill-transit
