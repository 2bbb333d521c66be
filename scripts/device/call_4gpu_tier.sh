#!/usr/bin/env bash
# 4 GPUs: the GPU tests (`pytest -m gpu`: tests/gpu and tests/dist/test_train_gpu.py) in four calls.
# Each part runs two groups concurrently on two GPU pairs (a file that runs two ranks uses cuda:0/1
# of what it sees, so CUDA_VISIBLE_DEVICES=0,1 and =2,3 are each the configuration it has on a
# 4-GPU machine), then one group on all four. The groups: scripts/device/gpu_tier_groups.py (a unit
# test holds them to the collected GPU tests). Logs and junit XML under $OUT.
#   scripts/device/call_4gpu_tier.sh [PART (1|2|3|4|5|6|7|8|9|10)] [SECONDS_FOR_THE_PAIRS] [SECONDS_FOR_THE_4_GPU_GROUP]
# On a 2-GPU machine the side-by-side groups get one GPU each (their two ranks share it over gloo,
# as the tests do on one GPU) and the last group runs on both: parts 2, 4, 6, 8 and 9 fit there (4's TP=2
# tests skip on one GPU), parts 3, 5, 7 and 10 need four.
set -u
source scripts/device/env.sh >/dev/null || exit 1
part=${1:-1}
# Parts 8 and 9 are Transformer Engine's: installed from the carried wheel (docs/transformer_engine.md); the other
# parts run without it, as their tests' --transformer-impl auto would otherwise pick TE's layers.
if [ "$part" = 8 ] || [ "$part" = 9 ]; then source scripts/te/install.sh || exit 1; fi
read -r PAIRS ALL pairs last < <(python3 - "$part" <<'PY'
import sys
sys.path.insert(0, "scripts/device")
from gpu_tier_groups import PARTS
if sys.argv[1] in PARTS:
    pair_groups, last_group, pair_s, last_s = PARTS[sys.argv[1]]
    print(",".join(pair_groups) or "-", last_group, pair_s, last_s)
PY
)
[ -n "${ALL:-}" ] || { echo "unknown part $part (see scripts/device/gpu_tier_groups.py)"; exit 2; }
pairs=${2:-$pairs}; last=${3:-$last}
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -ge 4 ]; then FIRST=0,1; SECOND=2,3; ALLGPUS=0,1,2,3
elif [ "$ngpu" -eq 2 ]; then FIRST=0; SECOND=1; ALLGPUS=0,1; echo "2 GPUs: side-by-side groups on one GPU each"
else echo "need 2 or 4 GPUs, found $ngpu"; exit 2; fi
run_group() {  # run_group NAME GPUS SECONDS
    local name=$1 gpus=$2 secs=$3
    mapfile -t ids < <(python3 scripts/device/gpu_tier_groups.py "$name")
    CUDA_VISIBLE_DEVICES=$gpus timeout "$secs" \
        python3 -m pytest -q -m gpu -p no:cacheprovider --durations=0 --junitxml="$OUT/$name.xml" --basetemp="/tmp/tier-$name" "${ids[@]}" \
        > "$OUT/$name.log" 2>&1
    echo "group $name (GPUs $gpus): rc=$?"
}
start=$SECONDS
done_groups=()
if [ "$PAIRS" != "-" ]; then
    IFS=, read -r P1 P2 <<< "$PAIRS"
    run_group "$P1" "$FIRST" "$pairs" &
    run_group "$P2" "$SECOND" "$pairs" &
    wait
    echo "pairs done in $((SECONDS - start)) s"
    for name in "$P1" "$P2"; do grep -E "passed|failed|error|PASSED|FAILED|ERROR|^[0-9.]+s (call|setup)" "$OUT/$name.log" | tail -20; done
    done_groups=("$P1" "$P2")
fi
start=$SECONDS
run_group "$ALL" "$ALLGPUS" "$last"
echo "last group (GPUs $ALLGPUS) in $((SECONDS - start)) s"; tail -3 "$OUT/$ALL.log"
python3 - "$OUT" "${done_groups[@]}" "$ALL" <<'PY'
import sys, os, xml.etree.ElementTree as ET
total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for name in sys.argv[2:]:
    f = os.path.join(sys.argv[1], name + ".xml")
    if not os.path.exists(f):
        print("no junit XML for group", name); continue
    suite = ET.parse(f).getroot().find("testsuite")
    for k in total:
        total[k] += int(suite.get(k, 0))
print("part total:", total)
PY
