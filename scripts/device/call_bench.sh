#!/usr/bin/env bash
# One 4-GPU device call: the side-by-side pipeline benchmark for the scenarios given
# (default "a"), its report and PNGs packed into $OUT/bench-<scenarios>.tar.gz (the device tool
# returns at most 8 files). Usage: bash scripts/device/call_bench.sh [SCENARIOS] [extra bench flags...]
set -u
source scripts/device/env.sh || exit 1
scen=${1:-a}; shift || true
python3 -m trainer.bench.pipeline --out /tmp/bench --report /tmp/bench/benchmarks.md --scenarios "$scen" \
    --train-iters 20 --line-timeout 150 --threads 4 "$@" 2>&1 | tail -n 60
cp /tmp/bench/benchmarks.md "$OUT/benchmarks-$scen.md" 2>/dev/null
(cd /tmp/bench && tar czf "$OUT/bench-$scen.tar.gz" --exclude='trace_rank*' --exclude='merged.json' .)
ls -la "$OUT"
