#!/usr/bin/env bash
# 2 or 4 GPUs, Transformer Engine's layers (the wheel scripts/te/build.sh made, carried in .te/wheel):
# the TE GPU test (megatron-core 1F1B, DPP eager and graphed: equal losses, every forward replayed),
# then the `transformer-engine` experiment (dated result file under $OUT), then, if time is left,
# the Llama GPU test (its TE part runs where TE imports). On one GPU: the TE test, then the graphed-vs-eager
# DPP tests (tests/gpu/test_dpp_cuda_graphs.py) in the time left. Every step bounded; the call ends in time.
#   run(command="bash scripts/device/call_te.sh", kind="nvidia-h200-x2", carry=[".whl", ".te/whl", ".te/wheel"])
set -u
BUDGET=${TE_CALL_BUDGET_S:-540}
start=$SECONDS
source scripts/device/env.sh || exit 1
source scripts/te/install.sh || exit 1
left() { echo $((BUDGET - (SECONDS - start))); }
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

gpu_pytest tests/gpu/test_te_gpu.py 420 "^[0-9]+ |replayed|passed|failed|Error|assert|skipped" 24

limit=$(( $(left) - 20 ))
if [ "$gpus" -lt 2 ]; then
    echo "== transformer-engine experiment: needs 2 GPUs (PP=2), $gpus here"
    # one GPU: the graphed-vs-eager tests, both ranks sharing it over gloo
    gpu_pytest tests/gpu/test_dpp_cuda_graphs.py $(( $(left) - 10 )) "passed|failed|Error|assert" 12 \
        ${TE_CALL_GRAPH_TESTS:+-k "$TE_CALL_GRAPH_TESTS"}
elif [ "$limit" -gt 120 ]; then
    python3 -m trainer.bench.run transformer-engine --gpus "$gpus" --results "$OUT" --time-limit "$limit" 2>&1 \
        | grep -E "^\[bench|Headline|^\[bench.run\]" | tail -20
else
    echo "== transformer-engine experiment: skipped, $(left) s left"
fi
if [ "$(left)" -gt 150 ]; then
    gpu_pytest tests/gpu/test_llama_gpu.py $(( $(left) - 10 )) "^[0-9]+ |passed|failed|Error|assert" 12
fi
echo "all in $((SECONDS - start)) s"
