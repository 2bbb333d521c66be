#!/usr/bin/env bash
# 4 GPUs, first call of the seventh session: (1) the launch probe (fast or slow host); (2) scenario (a),
# 1 round: megatron-core's best 1F1B against DPP graphs at 1F1B caps and with recompute at cap factor
# 1.5, each with and without --dpp-max-queued-ops 2, and eager dpp-zb with and without it; (3) the
# transport bench re-taken with the fixed receive (reads msg.tensor, so the payload is timed).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 430 python3 -m trainer.bench.pipeline --out /tmp/bench-q --report "$OUT/benchmarks-queued.md" \
    --scenarios a $B --rounds 1 \
    --lines megatron-1f1b-best,dpp-graphs,dpp-graphs-q2,dpp-graphs-rc-cf1.5,dpp-graphs-rc-cf1.5-q2,dpp-zb,dpp-zb-q2 \
    2>&1 | grep "^\[bench\]"
echo "=== transport bench"
timeout 100 python3 -m trainer.transport.bench --device cuda --transports shm,nccl --sizes 64K,8M,64M,256M \
    --repeats 10 --json "$OUT/bench-4gpu.json" 2>&1 | grep -v Warning | tail -n 14
