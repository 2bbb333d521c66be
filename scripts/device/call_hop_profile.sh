#!/usr/bin/env bash
# Issue 11: where a same-node GPU hop spends its host time (scripts/device/hop_profile.py), then the
# GPU transport tests and the bench's shm rows (on one GPU both ranks share it: host costs only).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
timeout 200 python3 scripts/device/hop_profile.py --sizes 64K,8M --iters 400 2>&1 | grep "^\[hop\]\|Error\|error" | tail -40
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_transport_gpu.py 2>&1 | tail -5
timeout 150 python3 -m trainer.transport.bench --device cuda --transports shm --sizes 64K,8M,64M --repeats 5 2>&1 | grep -v Warn | tail -12
