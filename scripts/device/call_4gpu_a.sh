#!/usr/bin/env bash
# 4 GPUs, first call of the session: (1) tests/dist/test_train_gpu.py's 4-GPU loss test (dpp, dpp-zb,
# graphs+recompute+cf1.5 vs megatron-core 1F1B); (2) the transport bench on 4 GPUs (same-node path with
# the doorbell spin, NCCL path; one-way, busy receiver, x send/recv, x peer copy); (3) the 2-GPU
# transport test files on this host.
set -u
here=$(dirname "$0")
bash "$here/call_4gpu_tests.sh" 260 tests/dist/test_train_gpu.py::test_dpp_first_ten_losses_match_megatron_1f1b_on_4_gpus
source scripts/device/env.sh >/dev/null || exit 1
echo "=== transport bench"
timeout 120 python3 -m trainer.transport.bench --device cuda --transports shm,nccl --sizes 64K,8M,64M,256M \
    --repeats 10 --json "$OUT/bench-4gpu.json" 2>&1 | grep -v Warning | tail -n 14
bash "$here/call_4gpu_tests.sh" 100 tests/gpu/test_transport_gpu.py tests/gpu/test_transport_nccl_gpu.py
