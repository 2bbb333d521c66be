#!/usr/bin/env bash
# 4 GPUs, eleventh session, issue 14: the StageLinks.landed GPU tests, then the pipeline benchmark's
# scenario (a) with dpp-zb told which gradients have landed (fill_transit, the default now) beside
# dpp and megatron-core's best 1F1B, at equal recompute (none; two recomputing slots on stage 0).
set -u
source scripts/device/env.sh >/dev/null || exit 1
CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
    "tests/gpu/test_transport_gpu.py::test_landed_says_no_until_the_payload_is_on_the_gpu" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|assert" | head -12
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 90 --rounds 1"
mkdir -p "$OUT/a"
timeout 330 python3 -m trainer.bench.pipeline --out /tmp/bench-wa --report "$OUT/a/benchmarks-w-a.md" --scenarios a $B \
    --lines megatron-1f1b-best,dpp-graphs,dpp-zb-graphs,dpp-graphs-rs2,dpp-zb-graphs-rs2 2>&1 | grep "^\[bench\]"
