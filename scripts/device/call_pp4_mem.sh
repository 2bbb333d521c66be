#!/usr/bin/env bash
# 4 GPUs, issue-12 model, one round: (a) peak *reserved* memory (what a graphed run really holds) of
# megatron-core's best 1F1B against DPP with graphs at 1F1B caps and with cap factors 1.25 / 1.5, after
# the shared backward pool; (d) the sample corpus's real document lengths (issue 13).
set -u
source scripts/device/env.sh || exit 1
python3 -m trainer.preprocess --input datasets/python-docs.jsonl.xz --output-prefix /tmp/corpus/gpt2 \
    --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt2/vocab.json --merge-file datasets/gpt2/merges.txt \
    --append-eod --workers 4 2>&1 | tail -1
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 80"
timeout 200 python3 -m trainer.bench.pipeline --out /tmp/bench-mem --report "$OUT/benchmarks-mem.md" --scenarios a \
    $B --lines megatron-1f1b-best,dpp-graphs,dpp-graphs-cf1.25,dpp-graphs-cf1.5 2>&1 | grep "^\[bench\]"
grep -h "reserved for them" /tmp/bench-mem/a-dpp-graphs*/*.log 2>/dev/null | sed 's/.*INFO//' | sort -u
timeout 120 python3 -m trainer.bench.pipeline --out /tmp/bench-d --report "$OUT/benchmarks-d.md" --scenarios d \
    $B --corpus /tmp/corpus/gpt2_text_document --lines megatron-1f1b-best,dpp-graphs-cf1.5 2>&1 | grep "^\[bench\]"
rm -f "$OUT"/timeline-a-*.png; ls "$OUT"
