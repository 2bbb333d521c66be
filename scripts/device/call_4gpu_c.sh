#!/usr/bin/env bash
# 4 GPUs, issue 12 goal 1 with and without CPU binding: the trainer's megatron-core 1F1B (best
# configuration) against megatron-core driven directly, first unbound (as every earlier call), then with
# each rank on its GPU's NUMA node (--cpu-bind numa, now the bench default) together with DPP's best line.
set -u
source scripts/device/env.sh >/dev/null || exit 1
nvidia-smi topo -m 2>/dev/null | head -8; lscpu | grep -E "^(Socket|NUMA|CPU\(s\)|Model name)"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
timeout 170 python3 -m trainer.bench.pipeline --out /tmp/bench-nb --report "$OUT/benchmarks-unbound.md" --cpu-bind none \
    --scenarios a $B --rounds 2 --lines megatron-1f1b-best,direct-megatron 2>&1 | grep "^\[bench\]"
timeout 360 python3 -m trainer.bench.pipeline --out /tmp/bench-nu --report "$OUT/benchmarks-numa.md" --cpu-bind numa \
    --scenarios a $B --rounds 3 --lines megatron-1f1b-best,direct-megatron,dpp-graphs-rc-cf1.5 2>&1 | grep "^\[bench\]"
head -2 /tmp/bench-nu/*/rank0.log | head -12
