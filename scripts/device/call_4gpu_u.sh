#!/usr/bin/env bash
# 4 GPUs, eleventh session, issue 14: why dpp-zb's iterations are bimodal on the GPU (call s: its
# fastest equal dpp's median, its slowest are 60-100 ms longer). Traced runs (--profile-dir: each op's
# GPU time from CUDA events) of dpp-zb-graphs and dpp-graphs on the issue-12 model, then the critical
# path of every iteration (trainer/profiling/critical_path.py): which ops and gaps made each step long,
# and how many backwards were queued behind a W that started after their gradient was there.
#   scripts/device/call_4gpu_u.sh [EXTRA_FLAGS_FOR_A_THIRD_ZB_RUN]
set -u
source scripts/device/env.sh >/dev/null || exit 1
source scripts/device/gpt16.sh
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
SPLIT="--decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 3 --optimizer sgd"
run() {  # run NAME FLAGS...
    local name=$1; shift
    gpt16 "$name" 14 $SPLIT --use-dpp --dpp-cuda-graphs --profile-dir "/tmp/prof-$name" "$@"
    timeout 120 python3 -m trainer.profiling.critical_path --benchmark_dir "/tmp/prof-$name" > "$OUT/path-$name.txt" 2>&1
    timeout 120 python3 -m trainer.profiling.critical_path --benchmark_dir "/tmp/prof-$name" --detail > "$OUT/path-$name-detail.txt" 2>&1
    grep -E "^iteration|^median" "$OUT/path-$name.txt" | cut -c1-400
    timeout 120 python3 -m trainer.profiling.aggregate --benchmark_dir "/tmp/prof-$name" --out "$OUT/merged-$name.json" 2>&1 | tail -4
}
run zb --dpp-policy dpp-zb
run dpp --dpp-policy dpp
[ $# -gt 0 ] && run zb-extra --dpp-policy dpp-zb "$@"
true
