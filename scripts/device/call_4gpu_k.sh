#!/usr/bin/env bash
# 4 GPUs, eighth session, issue 11, second call: the same-node GPU send commits its header before
# queueing the copy (flags only). (1) hop profile shm (and NCCL path, to see where its time goes);
# (2) transport bench; (3) GPU transport tests + the 2+2 node-split DPP test; (4) scenario (a) 1 round:
# megatron-core's best 1F1B and dpp-graphs-rs2.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
echo "=== hop profile"
timeout 60 python3 scripts/device/hop_profile.py --sizes 8M --iters 400 --no-pieces 2>&1 | grep "^\[hop\]\|Error" | tail -12
timeout 60 python3 scripts/device/hop_profile.py --sizes 8M --iters 200 --no-pieces --transport nccl 2>&1 | grep "^\[hop\]\|Error" | tail -12
echo "=== transport bench"
timeout 110 python3 -m trainer.transport.bench --device cuda --transports shm,nccl --sizes 64K,8M,64M,256M \
    --repeats 10 --json "$OUT/bench-4gpu-native-k.json" 2>&1 | grep -v Warning | tail -n 14
echo "=== GPU tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_transport_gpu.py \
    tests/gpu/test_transport_nccl_gpu.py tests/gpu/test_dpp_nccl_split.py 2>&1 | tail -3
echo "=== training"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 150 python3 -m trainer.bench.pipeline --out /tmp/bench-k --report "$OUT/benchmarks-k.md" \
    --scenarios a $B --rounds 1 --lines megatron-1f1b-best,dpp-graphs-rs2 2>&1 | grep "^\[bench\]"
