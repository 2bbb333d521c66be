#!/usr/bin/env bash
# 4 GPUs, issue-12 model (GPT 16L h2048, PP=4, M=32, balanced 5/4/4/3): speed and peak *reserved* memory
# of megatron-core's best 1F1B against DPP with graphs and selective recompute (--recompute-activations)
# at --dpp-cap-factor 1.5 and 1F1B caps; (a) uniform, 2 interleaved rounds; then (d) the sample
# corpus's real document lengths (issue 13), one round, megatron-1f1b-best against dpp-graphs-rc-cf1.5.
#   scripts/device/call_pp4_rc.sh [a|d|ad]
set -u
source scripts/device/env.sh || exit 1
what=${1:-ad}
B="--pipeline-parallel 4 --num-layers 16 --num-microbatches 32 --train-iters 8 --threads 4 --line-timeout 75"
if [[ $what == *a* ]]; then
    timeout 300 python3 -m trainer.bench.pipeline --out /tmp/bench-rc4 --report "$OUT/benchmarks-pp4-rc-a.md" \
        --scenarios a $B --rounds 2 --lines megatron-1f1b-best,dpp-graphs-rc-cf1.5,dpp-graphs-rc \
        2>&1 | grep "^\[bench\]"
fi
if [[ $what == *d* ]]; then
    source scripts/device/corpus.sh
    timeout 120 python3 -m trainer.bench.pipeline --out /tmp/bench-rc4 --report "$OUT/benchmarks-pp4-rc-d.md" \
        --scenarios d $B --corpus "$CORPUS" --lines megatron-1f1b-best,dpp-graphs-rc-cf1.5 2>&1 | grep "^\[bench\]"
fi
# Peak reserved per line, max over ranks, from the metrics the ranks wrote (survives a cut-off bench).
python3 - <<'PY'
import glob
from pathlib import Path
from trainer.bench.results import line_result
for d in sorted(Path(p) for p in glob.glob("/tmp/bench-rc4/*/")):
    r = line_result(d.name, d.name, d.name[0], "", d, 2)
    if r.reserved_gib is not None:
        print(f"{d.name}: peak reserved {r.reserved_gib:.2f} GiB (max of {len(r.metrics)} ranks; {r.status})")
PY
grep -h "reserved for them" /tmp/bench-rc4/*-dpp-graphs*/*.log 2>/dev/null | sed 's/.*INFO//' | sort -u
ls "$OUT"
