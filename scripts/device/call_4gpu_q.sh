#!/usr/bin/env bash
# 4 GPUs, ninth session: the NCCL path with and without the consumer's inbox spin, same call
# (MDPP_INBOX_SPIN_US=0 / 100 / 0), bench NCCL rows at 8 and 64 MiB with raw send/recv.
set -u
source scripts/device/env.sh >/dev/null || exit 1
python3 -m trainer.bench.launch_probe 2>&1 | grep "^\[host\]"
for spin in 0 100 0; do
    echo "=== MDPP_INBOX_SPIN_US=$spin"
    MDPP_INBOX_SPIN_US=$spin timeout 70 python3 -m trainer.transport.bench --device cuda --transports nccl \
        --sizes 8M,64M --repeats 10 --no-busy 2>&1 | grep -E "nccl|send/recv" | grep -v Warning
done
