#!/usr/bin/env bash
# 4 GPUs, eighth session, issue 11, third call: the transport bench with one untimed round trip
# before each timed burst (barrier skew no longer counted; baselines alike), then the whole GPU tier
# (`pytest -m gpu tests/gpu`, issue 11's must-show) with per-test durations.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
echo "=== transport bench"
timeout 110 python3 -m trainer.transport.bench --device cuda --transports shm,nccl --sizes 64K,8M,64M,256M \
    --repeats 10 --json "$OUT/bench-4gpu-native-l.json" 2>&1 | grep -v Warning | tail -n 16
echo "=== pytest -m gpu tests/gpu"
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu --durations=0 > "$OUT/gpu-tier.log" 2>&1
echo "rc=$?"
grep -E "passed|failed|error|s call|skipped" "$OUT/gpu-tier.log" | grep -v Warning | tail -30
