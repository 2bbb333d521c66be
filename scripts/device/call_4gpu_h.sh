#!/usr/bin/env bash
# 4 GPUs, last call of the seventh session: the 4-GPU loss test for the new candidate (graphs, per-slot
# recompute on stage 0, one-op run-ahead bound) against megatron-core's 1F1B, and the graphed-vs-eager
# equality tests of --dpp-recompute-slots and --dpp-max-queued-ops (2 ranks, 2 GPUs).
set -u
here=$(dirname "$0")
bash "$here/call_4gpu_tests.sh" 200 "tests/dist/test_train_gpu.py::test_dpp_first_ten_losses_match_megatron_1f1b_on_4_gpus[dpp-graphs-rs2-q1]"
bash "$here/call_4gpu_tests.sh" 130 "tests/gpu/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v1-recompute-slot]" \
    "tests/gpu/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v1-queued1]"
