#!/usr/bin/env bash
# Run a selection of tests ROUNDS times in a row under a bounded background CPU load, and after each
# round check that the round left nothing of its own in /dev/shm. The question it answers: do the
# transport and equivalence tests pass, and leave no shared-memory segment behind, when the host's
# cores are all busy with something else?
#
#   scripts/stress_tests.sh [--rounds N] [--load-procs K] [--no-load] [--round-timeout S] [-- PYTEST ARGS]
#
#   --rounds N         rounds (default 20)
#   --load-procs K     busy processes beside the tests (default: one per core, `nproc`)
#   --no-load          no background load (a baseline)
#   --round-timeout S  seconds one round may take before it is killed and counted as failed (default 3600)
#   PYTEST ARGS        what each round runs (default: the transport and equivalence tests below)
#
# The load is `stress-ng --cpu K` when stress-ng is installed (Debian: apt-get install stress-ng),
# else K Python busy loops; either way it is started for one round at a time, bounded by the round's
# timeout, and stopped (by the pids this script started) when the round ends or the script exits.
#
# Each round runs under its own MDPP_RUN_TAG (trainer/launch/run_token.py): tests/conftest.py adds its own
# random tag after it, so every segment the round's runs create is named /dev/shm/mdpp-<round tag>...
# and the check after the round looks at those names only: other runs on the host are never counted
# (their /dev/shm/mdpp* entries are reported, for information). Exit status: 0 when every round passed
# and left nothing, 1 otherwise. One summary line per round, then a total.
#
# What the concurrency goal takes beyond this script (not for a shared machine):
#   20 loaded rounds of the default selection:   scripts/stress_tests.sh --rounds 20
#   two full tiers from two clones at once:       git clone <repo> /tmp/a && git clone <repo> /tmp/b
#                                                 (cd /tmp/a && .ci/run) & (cd /tmp/b && .ci/run) & wait
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
ROUNDS=20
LOAD_PROCS=$(nproc)
ROUND_TIMEOUT=3600
DEFAULT_TESTS=(tests/dist/test_transport_channels.py tests/dist/test_transport_dist_protocol.py
               tests/dist/test_shm_names.py tests/dist/test_shm_cleanup.py tests/dist/test_dpp_equivalence.py)
PYTEST_ARGS=()

while (( $# )); do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        --load-procs) LOAD_PROCS=$2; shift 2 ;;
        --no-load) LOAD_PROCS=0; shift ;;
        --round-timeout) ROUND_TIMEOUT=$2; shift 2 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "stress_tests.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
for value in "$ROUNDS" "$LOAD_PROCS" "$ROUND_TIMEOUT"; do
    [[ $value =~ ^[0-9]+$ ]] || { echo "stress_tests.sh: '$value' is not a whole number (see --help)" >&2; exit 2; }
done
(( ${#PYTEST_ARGS[@]} )) || PYTEST_ARGS=("${DEFAULT_TESTS[@]}")

LOAD_PIDS=()
ROUND_PID=
stop_load() {
    local pid
    for pid in "${LOAD_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${LOAD_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
    LOAD_PIDS=()
}
# The round runs in the background and is waited for, so that a signal to this script is handled at
# once: the round's `timeout` passes it on to pytest, and the load stops.
trap 'stop_load' EXIT
trap '[[ -n $ROUND_PID ]] && kill "$ROUND_PID" 2>/dev/null; stop_load; exit 130' INT TERM

start_load() {  # $1: seconds at most
    (( LOAD_PROCS > 0 )) || return 0
    if command -v stress-ng >/dev/null; then
        stress-ng --cpu "$LOAD_PROCS" --timeout "${1}s" --quiet &
        LOAD_PIDS+=($!)
    else
        local i
        for (( i = 0; i < LOAD_PROCS; i++ )); do
            timeout "$1" "$PYTHON" -c 'while True: pass' &
            LOAD_PIDS+=($!)
        done
    fi
}

load_name() {
    if (( LOAD_PROCS == 0 )); then echo "none"
    elif command -v stress-ng >/dev/null; then echo "stress-ng --cpu $LOAD_PROCS"
    else echo "$LOAD_PROCS python busy loops"; fi
}

cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
run_tag="st$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
echo "stress_tests: $ROUNDS round(s) of: pytest ${PYTEST_ARGS[*]}"
echo "stress_tests: load: $(load_name) on $(nproc) core(s); round timeout ${ROUND_TIMEOUT}s; tag ${run_tag}r<round>"
failed=0
for (( round = 1; round <= ROUNDS; round++ )); do
    tag="${run_tag}r${round}"
    log=$(mktemp "/tmp/stress_tests.${tag}.XXXX.log")
    start_load "$ROUND_TIMEOUT"
    started=$SECONDS
    MDPP_RUN_TAG=$tag timeout "$ROUND_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider "${PYTEST_ARGS[@]}" >"$log" 2>&1 &
    ROUND_PID=$!
    wait "$ROUND_PID"
    rc=$?
    ROUND_PID=
    seconds=$(( SECONDS - started ))
    stop_load
    # The round's processes are gone (pytest waited for its ranks): anything of its tag left is a leak.
    mapfile -t left < <(find /dev/shm -maxdepth 1 -name "mdpp-${tag}*" -printf '%f\n' 2>/dev/null)
    others=$(find /dev/shm -maxdepth 1 -name 'mdpp*' ! -name "mdpp-${tag}*" 2>/dev/null | wc -l)
    counts=$(grep -E '[0-9]+ (passed|failed|errors?)( |,)' "$log" | tail -1 | tr -d '=')
    verdict=ok
    if (( rc != 0 )) || (( ${#left[@]} )); then
        verdict=FAIL
        failed=$(( failed + 1 ))
    fi
    echo "round $round/$ROUNDS: $verdict pytest exit $rc in ${seconds}s (${counts:-no summary}); left in /dev/shm: ${#left[@]}${left:+ (${left[*]})}; other runs' mdpp entries: $others; log $log"
    if [[ $verdict == ok ]]; then rm -f "$log"; fi
    for name in "${left[@]}"; do rm -f "/dev/shm/$name"; done  # so one leak is not counted again
done
echo "stress_tests: $(( ROUNDS - failed ))/$ROUNDS round(s) passed and left nothing behind"
(( failed == 0 ))
