#!/usr/bin/env bash
# 4 GPUs, ninth session, issue 11: the NCCL path after the consumer's 100 us inbox spin (one thread
# wake-up less per hop): hop profile, the bench's NCCL rows with raw send/recv, the GPU transport tests.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
timeout 60 python3 scripts/device/hop_profile.py --transport nccl --sizes 8M --iters 300 --no-pieces 2>&1 | grep "^\[hop\]\|Error" | tail -12
timeout 120 python3 -m trainer.transport.bench --device cuda --transports nccl --sizes 64K,8M,64M,256M \
    --repeats 10 --no-busy --json "$OUT/bench-4gpu-p.json" 2>&1 | grep -v Warning | tail -n 10
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_transport_gpu.py \
    tests/gpu/test_transport_nccl_gpu.py 2>&1 | tail -2
