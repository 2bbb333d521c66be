#!/usr/bin/env bash
# One 4-GPU device call: transport bench (same-node GPU path vs peer copy), then the GPT16 model under
# megatron-core's 1F1B and eager --use-dpp, a sync-debug pass and a traced DPP run.
set -u
source scripts/device/env.sh || exit 1
source scripts/device/gpt16.sh
timeout 150 python3 -m trainer.transport.bench --device cuda --transports shm --sizes 64K,1M,8M,64M,256M \
    --repeats 20 --json "$OUT/bench.json" 2>&1 | tail -n 15
gpt16 mcore-1f1b 12
gpt16 dpp 12 --use-dpp --dpp-eager
gpt16 dpp-syncdebug 3 --use-dpp --dpp-eager --cuda-sync-debug warn
grep -i -B2 -A6 "synchroniz" "$OUT/dpp-syncdebug.log" | head -n 60
gpt16 dpp-traced 6 --use-dpp --dpp-eager --profile-dir /tmp/prof
timeout 120 python3 -m trainer.profiling.aggregate --benchmark_dir /tmp/prof 2>&1 | tail -n 30
cp /tmp/prof/*.png /tmp/prof/summary* "$OUT"/ 2>/dev/null; ls /tmp/prof
