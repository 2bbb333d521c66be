#!/usr/bin/env bash
# 4 GPUs, for the next session: does deciding near GPU time (--dpp-max-queued-ops 2, run_ahead.py)
# remove the idle DPP stages showed on the fast host (docs/benchmarks.md, sixth session)? Scenario (a),
# 1 round: megatron-core's best 1F1B against DPP graphs at 1F1B caps and with recompute at cap factor
# 1.5, each with and without the bound, and eager dpp-zb with and without it (the policy the
# simulator prefers, which lost on GPUs by deciding on host-time readiness). Prints the launch probe.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 500 python3 -m trainer.bench.pipeline --out /tmp/bench-q --report "$OUT/benchmarks-queued.md" \
    --scenarios a $B --rounds 1 \
    --lines megatron-1f1b-best,dpp-graphs,dpp-graphs-q2,dpp-graphs-rc-cf1.5,dpp-graphs-rc-cf1.5-q2,dpp-zb,dpp-zb-q2 \
    2>&1 | grep "^\[bench\]"
