#!/usr/bin/env bash
# Why some of dpp-zb's iterations are slow on the GPU (on 4xH200 its fastest equalled dpp's median, its
# slowest were 60-100 ms longer; docs/schedules.md, "Split backward on the GPU"). Traced runs (--profile-dir: each op's
# GPU time from CUDA events) of graphed dpp-zb and dpp, then the critical path of every iteration
# (trainer/profiling/critical_path.py): which ops and gaps made each step long, and how many backwards
# were queued behind a W that started after their gradient was there.
# 4 GPUs: the benchmark model gpt16-h2048 (GPT 16L h2048 seq 1024 mbs 2, PP=4, M=32, split 5/4/4/3).
# 2 GPUs: GPT 8L, PP=2, M=16, split 5/3 (the same layers per stage as one PP=4 stage pair).
#   scripts/device/call_4gpu_u.sh [EXTRA_FLAGS_FOR_A_THIRD_ZB_RUN]
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -ge 4 ]; then
    PP=4; MODEL="--num-layers 16 --global-batch-size 64 --decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 3"
else
    PP=2; MODEL="--num-layers 8 --global-batch-size 32 --decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 3"
fi
BASE="--device cuda --mock-data --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 \
  --max-position-embeddings 1024 --vocab-size 50257 --micro-batch-size 2 --pipeline-model-parallel-size $PP \
  --bf16 --optimizer sgd --lr 1e-4 --hidden-dropout 0 --attention-dropout 0 --seed 1234 --log-interval 1 \
  --train-iters 14 --use-dpp --dpp-cuda-graphs $MODEL"
echo "PP=$PP: $MODEL"
trace_run() {  # trace_run NAME FLAGS...
    local name=$1; shift
    timeout 200 torchrun --standalone --nproc-per-node "$PP" -m trainer.train $BASE --run-name "$name" \
        --profile-dir "/tmp/prof-$name" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name (exit $?)"; grep -E "iteration +[0-9]+/" "$OUT/$name.log" | sed 's/.*\(iteration *[0-9]*\/.*elapsed[^|]*\).*/\1/' | tail -n 14
    grep -E "Error|error" "$OUT/$name.log" | tail -n 5
    # at most 8 files come back from a call: per run its log and one text file (summary, then the paths)
    timeout 120 python3 -m trainer.profiling.aggregate --benchmark_dir "/tmp/prof-$name" --out "/tmp/merged-$name.json" \
        > "$OUT/path-$name.txt" 2>&1
    tail -n 8 "$OUT/path-$name.txt"
    timeout 120 python3 -m trainer.profiling.critical_path --benchmark_dir "/tmp/prof-$name" --detail > /tmp/path.txt 2>&1
    cat /tmp/path.txt >> "$OUT/path-$name.txt"
    grep -E "^iteration|^median|critical_path:" /tmp/path.txt | cut -c1-420
    case $name in zb*) gzip -c "/tmp/merged-$name.json" > "$OUT/merged-$name.json.gz";; esac
}
trace_run zb --dpp-policy dpp-zb
trace_run dpp --dpp-policy dpp
[ $# -gt 0 ] && trace_run zb-extra --dpp-policy dpp-zb "$@"
true
