#!/usr/bin/env bash
# --dpp-cuda-graphs at TP=2 on 2 GPUs, in one call under 8 minutes: does the run now exit cleanly, and if
# anything hangs, where. Three bounded steps, each in a process group of its own that is sent SIGUSR1
# (every Python process dumps its threads' stacks: sitecustomize below), stacked by gdb when present,
# then killed at its deadline:
#   1. probe --free / --keep (nccl_graph_destroy_probe.py): does destroying a group wait for a live CUDA
#      graph that captured its all-reduce, on this NCCL? (--keep is expected to hit its deadline)
#   2. tests/gpu/test_tp_cuda_graphs.py::...[tp2]: eager vs graphed TP=2, every forward replayed, every
#      rank logs the graphs it freed and exits 0
#   3. the same with --sequence-parallel ([tp2-sp]), if time is left
# Diagnostics in the ranks: NCCL_DEBUG=WARN, torch's c10d lifecycle lines (TORCH_CPP_LOG_LEVEL=INFO:
# "destroying NCCL communicators", "Destroy complete"), the flight recorder dumped on a collective
# timeout (TORCH_NCCL_DUMP_ON_TIMEOUT, files under $OUT's archive), the trainer's own deadline on group
# destruction (60 s, names rank and group) and its stack dump over the whole tear-down.
# Back under $OUT (<= 8 files): summary.txt, probe.log, tp2.log, tp2-sp.log, ranks.tgz (rank logs,
# flight-recorder dumps, stacks).
#   run(command="bash scripts/device/tp_graphs_check.sh", kind="nvidia-h100-x2", carry=[".whl"], timeout_s=540)
# Dry run without GPUs: MDPP_DRY_RUN=1 bash scripts/device/tp_graphs_check.sh (checks paths and imports).
set -u
BUDGET=${TP_GRAPHS_BUDGET_S:-470}  # seconds for the whole call, set-up included (the call's limit: 540)
start=$SECONDS
if [ "${MDPP_DRY_RUN:-0}" = 1 ]; then
    OUT=${OUT:-/tmp/tpg-dry-out}; mkdir -p "$OUT"
else
    source scripts/device/env.sh || exit 1
fi
DIAG=/tmp/tpg-diag; RANKTMP=/tmp/tpg-ranks; FR=/tmp/tpg-fr
rm -rf "$DIAG" "$RANKTMP" "$FR"; mkdir -p "$DIAG" "$RANKTMP" "$FR"
cat > "$DIAG/sitecustomize.py" <<'PY'
# tp_graphs_check.sh: every Python process of a step dumps all its threads' stacks on SIGUSR1.
import faulthandler, signal
faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
PY
export PYTHONPATH="$DIAG:${PYTHONPATH:-$PWD}"
export NCCL_DEBUG=WARN TORCH_CPP_LOG_LEVEL=INFO TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_TRACE_BUFFER_SIZE=2000 \
       TORCH_FR_DUMP_TEMP_FILE="$FR/nccl_trace_rank_"
export TMPDIR=$RANKTMP  # the tests' launcher keeps each rank's log in a temporary folder: find it here
SUMMARY=$OUT/summary.txt; : > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME SECONDS LOG CMD...: CMD in its own process group; past SECONDS: stacks (SIGUSR1, gdb), then kill.
step() {
    local name=$1 secs=$2 log=$3; shift 3
    local left=$((BUDGET - (SECONDS - start)))
    [ "$secs" -gt "$left" ] && secs=$left
    if [ "$secs" -lt 30 ]; then say "== $name: skipped, ${left} s left of ${BUDGET} s"; return 99; fi
    local t0=$SECONDS
    setsid "$@" >> "$log" 2>&1 &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "$secs" ]; do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        say "== $name: still running after ${secs} s: stacks of every process in its group follow in $log"
        ps -o pid,stat,etime,args -g "$pid" >> "$log" 2>&1
        kill -USR1 -- "-$pid" 2>/dev/null; sleep 5
        if command -v gdb >/dev/null; then
            for p in $(pgrep -g "$pid" -f python); do
                echo "--- gdb bt of $p" >> "$log"
                timeout 30 gdb -p "$p" -batch -ex "thread apply all bt 30" >> "$log" 2>&1
            done
        fi
        kill -KILL -- "-$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
        say "== $name: killed at its deadline (rc 124)"
        return 124
    fi
    wait "$pid"; local rc=$?
    say "== $name: rc=$rc in $((SECONDS - t0)) s"
    return $rc
}

T=tests/gpu/test_tp_cuda_graphs.py::test_tp2_slot_graphs_equal_eager
PROBE=scripts/device/nccl_graph_destroy_probe.py
if [ "${MDPP_DRY_RUN:-0}" = 1 ]; then  # no GPU: the pieces exist and import, the test is collected
    python3 "$PROBE" --help > /dev/null && say "probe: imports and parses its arguments"
    python3 -c "import trainer.pipeline.graph_teardown, trainer.launch.exit_deadline; print('imports ok')" | tee -a "$SUMMARY"
    step collect 120 "$OUT/collect.log" python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider "$T[tp2]" "$T[tp2-sp]"
    grep -E "::|collected|error" "$OUT/collect.log" | tail -4 | tee -a "$SUMMARY"
    step sleeper 30 "$OUT/sleeper.log" python3 -c "import time; time.sleep(600)"  # the deadline path: must be killed
    [ $? -eq 124 ] && grep -q "Current thread\|Thread 0x" "$OUT/sleeper.log" && say "deadline path: stacks dumped, killed"
    exit 0
fi

RUN2=(python3 -m torch.distributed.run --nproc_per_node 2)  # the probe's two ranks; its own deadline: 20 s
step "probe --free" 60 "$OUT/probe.log" "${RUN2[@]}" --master_port 29511 "$PROBE" --free --deadline 20
step "probe --keep (expected: its deadline, in destroy)" 60 "$OUT/probe.log" "${RUN2[@]}" --master_port 29512 \
    "$PROBE" --keep --deadline 20
grep -E "^rank|destroyed|Timeout|nccl|File .*probe" "$OUT/probe.log" | head -30 | tee -a "$SUMMARY"

t() {  # t NAME SECONDS TEST
    step "$1" "$2" "$OUT/$1.log" env CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest -x -q -s -m gpu -p no:cacheprovider \
        --durations=0 --basetemp="/tmp/tpg-$1" "$3"
    local rc=$?
    grep -E "per rank|passed|failed|Error|assert|ERROR rank|did not finish|Destroy complete|destroying NCCL" \
        "$OUT/$1.log" | grep -v UserWarning | tail -20 | tee -a "$SUMMARY"
    return $rc
}
t tp2 270 "$T[tp2]"
if [ $((BUDGET - (SECONDS - start))) -ge 150 ]; then t tp2-sp 240 "$T[tp2-sp]"; else say "== tp2-sp: skipped (time)"; fi

tar -czf "$OUT/ranks.tgz" -C / "${RANKTMP#/}" "${FR#/}" 2>/dev/null
say "all in $((SECONDS - start)) s"
