#!/usr/bin/env bash
# 4 GPUs, ninth session, issue 11: what the cross-node (NCCL, header lines) path costs a DPP training
# step. Scenario (a) (GPT 16L h2048 seq 1024 mbs 2, PP=4, M=32, bf16), 1 round: megatron-core's best
# 1F1B and two DPP lines with every rank on one node, then the same DPP lines with the ranks told they
# sit on two nodes (MDPP_NODE_OF_RANK=0,0,1,1: edges 1<->2 and 3<->0 take the NCCL path).
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 75"
echo "=== one node"
timeout 240 python3 -m trainer.bench.pipeline --out /tmp/bench-o1 --report "$OUT/benchmarks-o-one-node.md" \
    --scenarios a $B --rounds 1 --lines megatron-1f1b-best,dpp-graphs-rs2,dpp-q1 2>&1 | grep "^\[bench\]"
echo "=== 2+2 nodes (NCCL path across)"
MDPP_NODE_OF_RANK=0,0,1,1 timeout 170 python3 -m trainer.bench.pipeline --out /tmp/bench-o2 \
    --report "$OUT/benchmarks-o-two-nodes.md" --scenarios a $B --rounds 1 --lines dpp-graphs-rs2,dpp-q1 2>&1 | grep "^\[bench\]"
grep -ho "stage links [^\"]*" /tmp/bench-o2/*/rank*.log 2>/dev/null | sort | uniq | head -8
