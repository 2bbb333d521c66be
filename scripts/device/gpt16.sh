# Sourced: the benchmark model gpt16-h2048 (trainer/bench/experiments.py) as trainer flags: GPT 16L h2048 16 heads seq 1024 mbs 2,
# bf16, PP=4, 32 microbatches, vocab 50257, mock data, dropout 0. Usage: gpt16 NAME ITERS [flags...]
GPT16="--device cuda --mock-data --num-layers 16 --hidden-size 2048 --num-attention-heads 16 \
  --seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257 --micro-batch-size 2 \
  --global-batch-size 64 --pipeline-model-parallel-size 4 --bf16 --lr 1e-4 --lr-warmup-iters 2 \
  --hidden-dropout 0 --attention-dropout 0 --seed 1234 --log-interval 1"
gpt16() {
    local name=$1 iters=$2; shift 2
    timeout 300 torchrun --standalone --nproc-per-node 4 -m trainer.train $GPT16 --train-iters "$iters" \
        --run-name "$name" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name (exit $?)"; grep -E "iteration +[0-9]+/|Error|error" "$OUT/$name.log" | tail -n 25
}
