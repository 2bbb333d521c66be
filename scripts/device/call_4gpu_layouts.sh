#!/usr/bin/env bash
# 4 GPUs: the runtime-launched overlapped DP reduction under CUDA graphs (its GPU test), then dpp-zb with
# sequence parallelism, the deferred weight GEMM keeping its TP-gathered input (keep) against gathering
# it again in W (regather): GPT16 model, PP=2 x TP=2, 32 microbatches, same call, same cards.
# run(command="bash scripts/device/call_4gpu_layouts.sh", kind="nvidia-h100-x4", carry=[".whl"])
set -u
source scripts/device/env.sh >/dev/null || exit 1
timeout 300 python3 -m pytest -m gpu -q -x tests/gpu/test_dpp_cuda_graphs.py \
    -k test_graphed_dpp_zb_with_overlapped_dp_reduction_equals_eager > "$OUT/gpu-overlap.log" 2>&1
echo "== graphs + overlap test (exit $?)"; tail -n 3 "$OUT/gpu-overlap.log"
source scripts/device/gpt16.sh
SP="--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --transformer-impl local \
  --use-dpp --dpp-eager --dpp-policy dpp-zb"
for input in keep regather; do
    gpt16 "sp-$input" 10 $SP --dpp-sp-wgrad-input "$input" --metrics-dir "$OUT/sp-$input"
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
# Median ms over iterations 3+ (unprofiled), peak reserved memory over ranks, the last loss.
for name in ("sp-keep", "sp-regather"):
    ranks = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1], name).glob("metrics_rank*.json"))]
    if not ranks:
        print(name, "no metrics"); continue
    its = [r for r in ranks[0]["iterations"] if r["iteration"] >= 3 and not r.get("gpu_profiled")]
    peak = max(r["peak_reserved_bytes"] or 0 for r in ranks) / 2**30
    print(f"{name}: median {statistics.median(r['ms'] for r in its):.1f} ms/iteration over {len(its)}, "
          f"peak reserved {peak:.2f} GiB, last losses {ranks[-1]['iterations'][-1]['losses']}")
PY
