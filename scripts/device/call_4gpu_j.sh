#!/usr/bin/env bash
# 4 GPUs, eighth session, issue 11: the same-node GPU hop issued natively (csrc/cuda_hop.cpp: one
# driver call per send, raw stream handles; was ~90-120 us of host Python per send). (1) launch probe;
# (2) per-phase host times of a 2-GPU ping-pong; (3) the transport bench (shm and NCCL paths against
# peer copy and raw send/recv, same run); (4) the GPU transport tests on 4 GPUs; (5) scenario (a),
# 1 round: megatron-core's best 1F1B, dpp-graphs-rs2 (q1 default), eager dpp-q1 and dpp-zb-q1.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
echo "=== hop profile (cuda:0 <-> cuda:1)"
timeout 80 python3 scripts/device/hop_profile.py --sizes 64K,8M --iters 400 2>&1 | grep "^\[hop\]\|Error" | tail -32
echo "=== transport bench"
timeout 110 python3 -m trainer.transport.bench --device cuda --transports shm,nccl --sizes 64K,8M,64M,256M \
    --repeats 10 --json "$OUT/bench-4gpu-native.json" 2>&1 | grep -v Warning | tail -n 14
echo "=== GPU transport tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_transport_gpu.py \
    tests/gpu/test_transport_nccl_gpu.py 2>&1 | tail -3
echo "=== training"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 250 python3 -m trainer.bench.pipeline --out /tmp/bench-j --report "$OUT/benchmarks-j.md" \
    --scenarios a $B --rounds 1 --lines megatron-1f1b-best,dpp-graphs-rs2,dpp-q1,dpp-zb-q1 \
    2>&1 | grep "^\[bench\]"
