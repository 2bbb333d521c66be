#!/usr/bin/env bash
# One 4-GPU device call (< 10 min) of the schedule-vs-static experiment for ONE scenario (a, c or d):
# python -m trainer.bench.run with --time-limit (the lines finished by then are written, and the result
# file says it was cut off), the dated result file and its timelines under $OUT (8 lines: 9 files), and
# each scenario's three ratios printed (vs megatron-core's best eager line, vs the best graphed static
# order, step vs the balanced limit).
#   run(command="bash scripts/device/call_schedule_vs_static.sh a", kind="nvidia-h100-x4", carry=[".whl"])
# Usage: bash scripts/device/call_schedule_vs_static.sh a|c|d [trainer.bench.pipeline flags, e.g. --resplit auto]
# --resplit auto: a profiling round per chunk count, the attention half's share measured on the GPU
# (trainer.measure.layer_halves), and the lines on the split the fit recommends -- in half layers where that is >= 2%
# faster: per stage for the v=1 lines, per virtual stage for the v=2 lines. Without the rounds (the model's splits for
# the 4xH200 costs, docs/schedules.md): --pipeline-stage-layers 4,4.5,4.5,3 --pipeline-stage-layers-vp 2,1.5,2,2,2.5,2.5,2.5,1
# v=2, dpp-zb's forwards after their data landed (the default) against queued on their header (-headers) and with the
# run-ahead bound lifted (-q0); the host-time model: 362.20 / 477.70 / 371.09 against the interleaved order's 369.69
# (docs/schedules.md):
#   ... a --lines interleaved-graphs,dpp-zb-graphs-v2,dpp-zb-graphs-v2-headers,dpp-zb-graphs-v2-q0,dpp-graphs-v2 \
#       --pipeline-stage-layers-vp 2,1.5,2,2,2.5,2.5,2.5,1
# v=2 with the youngest deferred W first (the default under graphs) against the oldest first (-oldest-w):
#   ... a --lines interleaved-graphs,dpp-zb-graphs-v2,dpp-zb-graphs-v2-oldest-w --pipeline-stage-layers-vp 2,1.5,2,2,2.5,2.5,2.5,1
# v=2 memory: the slots sharing p sets of W's operand buffers (the default) against a set per slot (-sets-slots):
#   ... a --lines interleaved-graphs,dpp-zb-graphs-v2,dpp-zb-graphs-v2-sets-slots --pipeline-stage-layers-vp 2,1.5,2,2,2.5,2.5,2.5,1
# W's operands copied only when another backward comes first (the default) against inside every I, in one call:
#   ... a --lines 1f1b-graphs,zb-h1-graphs,dpp-zb-graphs,dpp-zb-graphs-copy-in-i --pipeline-stage-layers 4,4.5,4.5,3
# GPUS=2 runs it at PP=2 on a 2-GPU machine (the experiment's default is 4).
# CPU dry run of the same path: python -m trainer.bench.run schedule-vs-static --device cpu --scenarios a \
#   --results /tmp/r --time-limit 900 -- --lines megatron-1f1b-best,1f1b-eager,dpp-zb
set -u
scen=${1:?usage: call_schedule_vs_static.sh a|c|d [pipeline flags]}; shift
source scripts/device/env.sh || exit 1
corpus=()
if [ "$scen" = d ]; then source scripts/device/corpus.sh; corpus=(--corpus "$CORPUS"); fi
extra=()
[ $# -gt 0 ] && extra=(-- "$@")
# 470 s for the tool: the wheels, the build and the copy-back fit in the rest of the 600 s call.
python3 -m trainer.bench.run schedule-vs-static ${GPUS:+--gpus "$GPUS"} --scenarios "$scen" ${corpus[@]+"${corpus[@]}"} --results "$OUT" \
    --out /tmp/bench-svs --time-limit 470 ${extra[@]+"${extra[@]}"} 2>&1 | grep -E "^\[bench(\.run)?\]"
ls -la "$OUT"
