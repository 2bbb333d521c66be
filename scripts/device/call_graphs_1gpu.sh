#!/usr/bin/env bash
# One GPU: --dpp-cuda-graphs equals eager DPP (two ranks sharing the GPU over gloo).
set -u
source scripts/device/env.sh || exit 1
G="--device cuda --mock-data --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \
  --max-position-embeddings 128 --vocab-size 1000 --micro-batch-size 2 --global-batch-size 16 \
  --pipeline-model-parallel-size 2 --lr 1e-3 --train-iters 2 --hidden-dropout 0 --attention-dropout 0 \
  --use-dpp --dpp-timeout 60 --distributed-backend gloo --dpp-cuda-graphs --bf16"
timeout 120 torchrun --standalone --nproc-per-node 2 -m trainer.train $G > /tmp/g.log 2>&1; rc=$?; echo "graphed probe exit $rc"
if [ $rc -ne 0 ]; then grep -vE "Warning|warnings.warn" /tmp/g.log | grep -B2 -A40 -m1 "Traceback" | cut -c1-220 | head -60; exit 1; fi
grep -E "replayed|CUDA graphs" /tmp/g.log
timeout 420 python3 -m pytest -x -q -s -m gpu -p no:cacheprovider tests/gpu/test_dpp_cuda_graphs.py 2>&1 | grep -vE "UserWarning|warnings.warn|^$" | tail -30
