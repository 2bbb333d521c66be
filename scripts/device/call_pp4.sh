#!/usr/bin/env bash
# 4-GPU call (issue 12 configuration: GPT 16L h2048 seq 1024, PP=4, M=32): scenarios a/b/c for
# megatron-core's best 1F1B, dpp and dpp-zb; the 4-GPU NCCL-links equivalence test; a short
# same-node transport bench (8 MiB latency after the doorbell spin).
set -u
source scripts/device/env.sh || exit 1
nvidia-smi topo -m | head -6
timeout 390 python3 -m trainer.bench.pipeline --out /tmp/bench --report "$OUT/benchmarks.md" --scenarios a,b,c \
    --pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 12 --line-timeout 70 --threads 4 \
    --lines megatron-1f1b-best,dpp,dpp-zb 2>&1 | grep "^\[bench\]"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_dpp_nccl_split.py 2>&1 | tail -5
timeout 50 python3 -m trainer.transport.bench --device cuda --transports shm --sizes 64K,8M,64M --repeats 10 --no-busy 2>&1 \
    | grep -E "^ +[0-9]|^#"
rm -f "$OUT"/*.png; cp /tmp/bench/timeline-a-dpp.png /tmp/bench/timeline-a-dpp-zb.png /tmp/bench/timeline-b-dpp.png "$OUT"/ 2>/dev/null
ls "$OUT"
