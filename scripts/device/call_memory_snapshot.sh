#!/usr/bin/env bash
# 4 GPUs: where each rank's reserved memory goes, megatron-core's eager 1F1B against --use-dpp's default, on
# the layouts benchmark's GPT PP=4 (gpt16-h2048, Adam, split 5/4/4/3): 4 iterations each with
# --record-memory-history, then trainer.profiling.memory_summary per rank (reserved per pool, the ordinary
# pool's live tensors by who allocated them, the peak and what reached it). BERT PP=4 too with BERT=1.
#   run(command="bash scripts/device/call_memory_snapshot.sh", kind="nvidia-h200-x4", carry=[".whl"])
# The summaries come back (one text file per line); the snapshots stay on the machine (tens of MB each).
set -u
source scripts/device/env.sh >/dev/null || exit 1
source scripts/device/gpt16.sh
SPLIT="--optimizer adam --transformer-impl local --decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 3"
snap() {  # snap NAME [flags]: one line, its snapshots under /tmp/snap/NAME, its summary to $OUT/NAME.txt
    local name=$1; shift
    gpt16 "$name" 4 $SPLIT --record-memory-history --memory-snapshot-path "/tmp/snap/$name/snapshot.pickle" "$@"
    python3 -m trainer.profiling.memory_summary /tmp/snap/"$name"/snapshot_rank{0,1,2,3}.pickle --top 10 \
        > "$OUT/$name.txt" 2>&1
    grep -E "^==|GiB in all|peak reserved|reached at" "$OUT/$name.txt"
}
snap mem-megatron-1f1b --no-batch-p2p-sync
snap mem-dpp-default --use-dpp
if [ "${BERT:-0}" = 1 ]; then
    GPT16=${GPT16/--num-layers 16/--model bert --num-layers 16}
    GPT16=${GPT16/--seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257 --micro-batch-size 2/--seq-length 512 --max-position-embeddings 512 --vocab-size 30522 --micro-batch-size 4}
    GPT16=${GPT16/--global-batch-size 64/--global-batch-size 128}
    SPLIT="--optimizer adam --transformer-impl local"
    snap mem-bert-megatron-1f1b --no-batch-p2p-sync
    snap mem-bert-dpp-default --use-dpp
fi
