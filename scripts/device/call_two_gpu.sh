#!/usr/bin/env bash
# One 2-GPU device call: same-node GPU path and NCCL path benches (2 ranks on 2 GPUs), the GPU test
# tier, and the pipeline benchmark at PP=2 (GPT 8 layers, otherwise the issue-12 model, 16 microbatches).
set -u
source scripts/device/env.sh || exit 1
nvidia-smi topo -m | head -n 4
echo "== shm (same-node GPU path) bench"
timeout 120 python3 -m trainer.transport.bench --device cuda --transports shm --sizes 64K,1M,8M,64M,256M --repeats 10 \
    --json "$OUT/bench-shm.json" 2>&1 | tail -n 20
echo "== nccl random order x20"
timeout 150 python3 -m trainer.transport.bench --device cuda --transports nccl --random-order --rounds 20 \
    --sizes 64K,1M,8M,64M 2>&1 | tail -n 8; echo "exit ${PIPESTATUS[0]}"
echo "== nccl bench"
timeout 120 python3 -m trainer.transport.bench --device cuda --transports nccl --sizes 8M,64M,256M --repeats 5 \
    --json "$OUT/bench-nccl.json" 2>&1 | tail -n 12
echo "== gpu tests"
timeout 240 python3 -m pytest -m gpu tests/gpu -v -x -p no:cacheprovider 2>&1 | tail -n 15
echo "== pipeline bench PP=2"
timeout 280 python3 -m trainer.bench.pipeline --out /tmp/bench --report /tmp/bench/benchmarks.md --scenarios a \
    --pipeline-parallel 2 --num-layers 8 --num-microbatches 16 --train-iters 12 --line-timeout 90 --threads 4 \
    --lines megatron-1f1b-default,megatron-1f1b-best,dpp,dpp-zb,direct-megatron 2>&1 | tail -n 40
cp /tmp/bench/benchmarks.md "$OUT/benchmarks-pp2.md" 2>/dev/null
(cd /tmp/bench && tar czf "$OUT/bench-pp2.tar.gz" --exclude='trace_rank*' --exclude='merged.json' .)
