#!/usr/bin/env bash
# 4 GPUs, eighth session, issue 11, last call: after trimming the per-message Python (decoded headers
# shared, validation fast path, no torch.device per send): hop profile, the bench's same-node rows
# (with baselines), and the GPU transport tests (flags/events under sync-debug "error", NCCL path).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
timeout 50 python3 scripts/device/hop_profile.py --sizes 8M --iters 400 --no-pieces 2>&1 | grep "^\[hop\]\|Error" | tail -12
timeout 90 python3 -m trainer.transport.bench --device cuda --transports shm --sizes 8M,64M,256M \
    --repeats 10 --json "$OUT/bench-4gpu-native-m.json" 2>&1 | grep -v Warning | tail -n 12
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_transport_gpu.py \
    tests/gpu/test_transport_nccl_gpu.py 2>&1 | tail -2
