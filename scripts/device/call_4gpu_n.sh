#!/usr/bin/env bash
# 4 GPUs, ninth session, issue 11: the gloo/NCCL path with headers on TCP header lines instead of a
# gloo group (trainer/transport/header_lines.py): NCCL hop profile, the bench's NCCL and same-node rows
# (baselines in the same run), and the GPU transport tests + the 2+2 node-split DPP training.
set -u
source scripts/device/env.sh || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
timeout 60 python3 scripts/device/hop_profile.py --transport nccl --sizes 8M --iters 300 --no-pieces 2>&1 | grep "^\[hop\]\|Error" | tail -12
timeout 150 python3 -m trainer.transport.bench --device cuda --transports shm,nccl --sizes 64K,8M,64M,256M \
    --repeats 10 --json "$OUT/bench-4gpu-n.json" 2>&1 | grep -v Warning | tail -n 16
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_transport_gpu.py \
    tests/gpu/test_transport_nccl_gpu.py tests/gpu/test_dpp_nccl_split.py > "$OUT/tests-n.log" 2>&1; echo "tests rc=$?"
tail -3 "$OUT/tests-n.log"
