#!/usr/bin/env bash
# 4 GPUs, second call of the seventh session: (a) megatron-core's best 1F1B against DPP graphs with the
# run-ahead bound (q1, q2), with per-slot recompute on stage 0 (--dpp-recompute-slots 1 / 2: the memory
# of dpp-graphs cut to megatron's +10%), recompute+cf1.5 at q1, and v=2 (interleaved vs graphs-v2-q2);
# (c) transient stalls: megatron best vs dpp-graphs-rs1-q2. Losses of every line in the reports.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 330 python3 -m trainer.bench.pipeline --out /tmp/bench-f --report "$OUT/benchmarks-f-a.md" \
    --scenarios a $B --rounds 1 \
    --lines megatron-1f1b-best,dpp-graphs-q2,dpp-graphs-rs1-q2,dpp-graphs-rs2-q2,dpp-graphs-q1,dpp-graphs-rc-cf1.5-q1,megatron-interleaved-v2,dpp-graphs-v2-q2 \
    2>&1 | grep "^\[bench\]"
grep -rhoE "stage [0-9]+: CUDA graphs.*" /tmp/bench-f 2>/dev/null | sort -u | head -12
timeout 120 python3 -m trainer.bench.pipeline --out /tmp/bench-fc --report "$OUT/benchmarks-f-c.md" \
    --scenarios c $B --rounds 1 --lines megatron-1f1b-best,dpp-graphs-rs1-q2 2>&1 | grep "^\[bench\]"
