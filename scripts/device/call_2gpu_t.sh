#!/usr/bin/env bash
# 2 GPUs, tenth session, issue 14 (the 4-GPU machines were not lent): dpp against dpp-zb, both with
# CUDA graphs and no recompute, beside megatron-core's best 1F1B, same call, same cards. PP=2, GPT 8
# layers h2048 seq 1024 mbs 2, M=16, bf16, 10 iterations, scenario (a).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
mkdir -p "$OUT/a"
timeout 280 python3 -m trainer.bench.pipeline --out /tmp/bench-ta --report "$OUT/a/benchmarks-t-a.md" --scenarios a \
    --pipeline-parallel 2 --num-layers 8 --num-microbatches 16 --train-iters 10 --threads 4 --line-timeout 80 --rounds 1 \
    --lines megatron-1f1b-best,dpp-graphs,dpp-zb-graphs 2>&1 | grep "^\[bench\]"
grep -h "CUDA graphs for chunk" /tmp/bench-ta/*/rank*.log 2>/dev/null | sed 's/.*\(stage [0-9]*: CUDA graphs\)/\1/' | sort | uniq
