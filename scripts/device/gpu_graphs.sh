#!/usr/bin/env bash
# CUDA graphs with dropout, BERT, TP=2 (+ sequence parallelism) and megatron-core's graphs at PP=2:
# their GPU tests on 1 or 2 GPUs in under 8 minutes, logs and junit XML under $OUT. Three pytest runs
# side by side (tiny models: they share GPUs fine): the one-GPU tests in two halves (their two ranks
# share a GPU over gloo), and with 2 GPUs the TP=2 tests and megatron-core's PP=2 graphs on both (NCCL
# needs a GPU per rank: with one GPU they skip). PP=2 x TP=2 needs 4 GPUs: scripts/device/call_4gpu_tier.sh 4.
#   run(command="bash scripts/device/gpu_graphs.sh", kind="nvidia-h100-x2", carry=[".whl"])
set -u
source scripts/device/env.sh || exit 1
G=tests/gpu
t() {  # t NAME GPUS SECONDS TEST...
    local name=$1 gpus=$2 secs=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpus timeout "$secs" python3 -m pytest -q -s -m gpu -p no:cacheprovider \
        --durations=0 --junitxml="$OUT/$name.xml" --basetemp="/tmp/g-$name" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name (GPUs $gpus) rc=$?"
    grep -E "passed|failed|skipped|Error|assert|^[0-9.]+s call" "$OUT/$name.log" | tail -12
}
A=("$G/test_graph_rng.py" "$G/test_dpp_cuda_graphs.py::test_graphed_dropout_repeats_from_its_seed_and_stays_close_to_eager")
B=("$G/test_dpp_cuda_graphs.py::test_graphed_bert_equals_eager_bert" "$G/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp[v1]")
M=$G/test_megatron_cuda_graphs.py  # PP=2 needs 2 GPUs (megatron-core's schedule runs over NCCL only)
start=$SECONDS
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    t two 0,1 420 "$G/test_tp_cuda_graphs.py::test_tp2_slot_graphs_equal_eager" "$M" &
    t one-b 1 420 "${B[@]}" &
    t one-a 0 420 "${A[@]}" &
else
    t one-b 0 420 "${B[@]}" &
    t one-a 0 420 "${A[@]}" "$M" &
fi
wait
echo "all in $((SECONDS - start)) s"
