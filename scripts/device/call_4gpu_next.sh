#!/usr/bin/env bash
# 4 GPUs, for the next session (after the seventh): (1) the launch probe -- a fast host (<= ~6 us per
# launch) is the one that settles issue 12 in one call; (2) scenario (a), 2 rounds: megatron-core's
# best 1F1B, megatron-core driven directly (goal 1), the candidate dpp-graphs-rs2 (its default run-ahead
# bound is 1 with graphs), and eager dpp / dpp-zb with the bound q1 (eager DPP's default is
# still unbounded: is q1 better there too?).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 520 python3 -m trainer.bench.pipeline --out /tmp/bench-next --report "$OUT/benchmarks-next.md" \
    --scenarios a $B --rounds 2 \
    --lines megatron-1f1b-best,direct-megatron,dpp-graphs-rs2,dpp-q1,dpp-zb-q1 \
    2>&1 | grep "^\[bench\]"
