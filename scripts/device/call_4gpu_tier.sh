#!/usr/bin/env bash
# 4 GPUs, ninth session: the whole GPU tier (`pytest -m gpu tests/gpu`) in one call, as two
# concurrent halves on two GPU pairs (every file but test_dpp_nccl_split.py runs two ranks on
# cuda:0/1 of what it sees, so CUDA_VISIBLE_DEVICES=0,1 and =2,3 are each the configuration the
# file has on a 4-GPU machine), then the one 4-rank file on all four. Logs and junit XML under $OUT.
#   scripts/device/call_4gpu_tier.sh [SECONDS_FOR_THE_HALVES] [SECONDS_FOR_THE_4_GPU_FILE]
set -u
source scripts/device/env.sh >/dev/null || exit 1
halves=${1:-400}; last=${2:-140}
g=tests/gpu
A=("$g/test_transport_gpu.py" "$g/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v1]"
   "$g/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v2]"
   "$g/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v1-varlen]" "$g/test_megatron_cuda_graphs.py")
B=("$g/test_transport_nccl_gpu.py" "$g/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v1-recompute]"
   "$g/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v1-queued1]"
   "$g/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v1-recompute-slot]"
   "$g/test_checkpoint_gpu.py" "$g/test_gpu_spans.py")
half() {  # half NAME GPUS TEST...
    local name=$1 gpus=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpus timeout "$halves" \
        python3 -m pytest -q -m gpu -p no:cacheprovider --durations=0 --junitxml="$OUT/$name.xml" --basetemp="/tmp/tier-$name" "$@" \
        > "$OUT/$name.log" 2>&1
    echo "half $name (GPUs $gpus): rc=$?"
}
start=$SECONDS
half A 0,1 "${A[@]}" &
half B 2,3 "${B[@]}" &
wait
echo "halves done in $((SECONDS - start)) s"
for name in A B; do grep -E "passed|failed|error|PASSED|FAILED|ERROR|^[0-9.]+s (call|setup)" "$OUT/$name.log" | tail -20; done
start=$SECONDS
timeout "$last" python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/C.xml" "$g/test_dpp_nccl_split.py" \
    > "$OUT/C.log" 2>&1; echo "4-GPU file: rc=$? in $((SECONDS - start)) s"; tail -3 "$OUT/C.log"
python3 - "$OUT" <<'PY'
import sys, glob, xml.etree.ElementTree as ET
total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for f in sorted(glob.glob(sys.argv[1] + "/[ABC].xml")):
    suite = ET.parse(f).getroot().find("testsuite")
    for k in total:
        total[k] += int(suite.get(k, 0))
print("tier total:", total)
PY
