#!/usr/bin/env bash
# One device call: how much of DPP's win is the schedule. On the GPUs present (2: PP=2, 4: PP=4; the
# benchmark model GPT 16L h2048 seq 1024 mbs 2, M=32, bf16, scenario (a), 10 iterations) ONE bench call
# runs megatron-core's best eager 1F1B, the static orders replayed by the DPP runtime through the same
# CUDA graph slots (1f1b-graphs, interleaved-graphs, zb-h1-graphs), graphed dpp / dpp-zb and graphed v=2 dpp
# with enough recomputing slots for interleaved-graphs' memory (dpp-graphs-v2-parity), then prints
# the report's headline: vs megatron's best eager line, vs the best graphed static line, step vs the
# balanced limit (sum of per-stage GPU busy / PP). Report and per-line logs under $OUT.
#   run(command="bash scripts/device/bench_static.sh", kind="nvidia-h100-x2", carry=[".whl"])
# CPU dry run (no wheels, no GPU; graphed lines are listed as not run, their eager twins stand in):
#   DEVICE=cpu OUT=/tmp/bs bash scripts/device/bench_static.sh
# Extra arguments go to python -m trainer.bench.pipeline (e.g. --resplit auto, --lines ...).
set -u
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LINES=megatron-1f1b-best,1f1b-graphs,interleaved-graphs,zb-h1-graphs,dpp-graphs,dpp-zb-graphs,dpp-graphs-v2-parity
if [ "$DEVICE" = cuda ]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
    export PYTHONUNBUFFERED=1
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
    python3 setup.py build_ext --inplace -q >/tmp/build_ext.log 2>&1 || { tail -20 /tmp/build_ext.log; exit 1; }
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    PP=$(python3 -c "import torch; print(min(torch.cuda.device_count(), 4))")
    [ "$PP" -ge 2 ] || { echo "needs 2 or 4 GPUs, found $PP"; exit 1; }
    [ "$PP" -eq 3 ] && PP=2
    SIZES="--num-layers 16 --num-microbatches 32 --train-iters 10 --threads 4 --line-timeout 90"
    python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
else
    PP=2
    LINES=$LINES,1f1b-eager,interleaved-eager,zb-h1-eager,dpp
    SIZES="--device cpu --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128
           --micro-batch-size 2 --num-microbatches 4 --train-iters 4 --no-bf16 --line-timeout 300"
fi
echo "bench_static: PP=$PP on $DEVICE, lines $LINES"
timeout 480 python3 -m trainer.bench.pipeline --out /tmp/bench-static --report "$OUT/benchmarks-static.md" \
    --scenarios a --pipeline-parallel "$PP" $SIZES --lines "$LINES" "$@" 2>&1 | grep "^\[bench\]"
for d in /tmp/bench-static/*/; do  # each line's rank logs, tails only (what failed and the graph memory lines)
    grep -hE "CUDA graphs for|static .* holds|replayed from CUDA graphs|Error|error" "$d"/rank*.log 2>/dev/null \
        | tail -n 16 > "$OUT/log-$(basename "$d").txt"
done
echo "---- headline (from $OUT/benchmarks-static.md)"
sed -n '/\*\*Headline\*\*/,/^$/p' "$OUT/benchmarks-static.md"
grep -E "^\| (megatron|1f1b|interleaved|zb-h1|dpp)" "$OUT/benchmarks-static.md" | cut -d'|' -f2,4,8,10,11,12
