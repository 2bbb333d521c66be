#!/usr/bin/env bash
# One GPU: the graphed-recompute equivalence test, then each rank's peak reserved memory of the pipeline
# benchmark's DPP lines, the ranks sharing the GPU (scripts/device/mem_1gpu.py says how).
#   [SKIP_TEST=1] scripts/device/call_mem_1gpu.sh [--pp4] [--graph-mem] [LINE ...]   e.g. --pp4 dpp dpp-graphs-rc-cf1.5
# --graph-mem: per graphed line, the peak at the end of the graph capture and the steady state's, with each
# chunk's warm-up cache kept through its captures and released before them (SKIP_TEST=1 ... --pp4 --graph-mem
# runs dpp-zb-graphs, then interleaved-graphs, at PP=4: four short runs; MEM_TIMEOUT bounds the whole).
set -u
source scripts/device/env.sh || exit 1
[ "${SKIP_TEST:-0}" = 1 ] || timeout 200 python3 -m pytest -x -q -s -m gpu -p no:cacheprovider -k recompute tests/gpu/test_dpp_cuda_graphs.py 2>&1 \
    | grep -vE "UserWarning|warnings.warn|^$" | grep -E "replayed|^[0-9]|passed|failed|Error|assert" | tail -20
timeout "${MEM_TIMEOUT:-480}" python3 scripts/device/mem_1gpu.py "$@"
