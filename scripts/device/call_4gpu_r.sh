#!/usr/bin/env bash
# 4 GPUs, tenth session, issue 14: dpp-zb with CUDA graphs (F, I and W graphs per slot) against the
# fastest dpp line and megatron-core's best 1F1B, same call, same cards. Issue-12 model (GPT 16L h2048
# seq 1024 mbs 2, PP=4, M=32, bf16), 10 iterations per line, 1 round; scenario (a) uniform and (c)
# transient stalls. Each scenario's report in its own folder (timeline PNGs are named per line).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 90 --rounds 1"
mkdir -p "$OUT/a" "$OUT/c"
echo "=== (a) uniform"
timeout 300 python3 -m trainer.bench.pipeline --out /tmp/bench-ra --report "$OUT/a/benchmarks-r-a.md" --scenarios a $B \
    --lines megatron-1f1b-best,dpp-graphs-rs2,dpp-zb-graphs,dpp-zb-graphs-rs2 2>&1 | grep "^\[bench\]"
echo "=== (c) transient stalls"
timeout 230 python3 -m trainer.bench.pipeline --out /tmp/bench-rc --report "$OUT/c/benchmarks-r-c.md" --scenarios c $B \
    --lines megatron-1f1b-best,dpp-graphs-rs2,dpp-zb-graphs-rs2 2>&1 | grep "^\[bench\]"
grep -h "CUDA graphs for chunk" /tmp/bench-ra/*/rank*.log 2>/dev/null | sed 's/.*\(stage [0-9]*: CUDA graphs\)/\1/' | sort | uniq | head -12
