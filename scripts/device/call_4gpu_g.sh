#!/usr/bin/env bash
# 4 GPUs, third call of the seventh session: the candidate for issue 12's goals -- DPP graphs deciding
# with at most one op queued ahead (q1) and two of stage 0's slots recomputing the core attention
# (rs2: megatron-core's memory +4%) -- against megatron-core's best 1F1B in 2 interleaved rounds
# (scenario a), v=2 at q1 against megatron's interleaved, and (c) transient stalls.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 250 python3 -m trainer.bench.pipeline --out /tmp/bench-g --report "$OUT/benchmarks-g-a.md" \
    --scenarios a $B --rounds 2 --lines megatron-1f1b-best,dpp-graphs-rs2-q1 2>&1 | grep "^\[bench\]"
timeout 130 python3 -m trainer.bench.pipeline --out /tmp/bench-g1 --report "$OUT/benchmarks-g-a1.md" \
    --scenarios a $B --rounds 1 --lines dpp-graphs-rs1-q1,megatron-interleaved-v2,dpp-graphs-v2-q1 2>&1 | grep "^\[bench\]"
timeout 110 python3 -m trainer.bench.pipeline --out /tmp/bench-gc --report "$OUT/benchmarks-g-c.md" \
    --scenarios c $B --rounds 1 --lines megatron-1f1b-best,dpp-graphs-rs2-q1 2>&1 | grep "^\[bench\]"
