"""The NCCL channels on real GPUs: bounded, never hanging. Needs 2 GPUs::

    python -m pytest -m gpu tests/gpu/test_transport_nccl_gpu.py -v

Every wait in these runs is bounded (links timeout 30 s, processes killed after a few minutes), so
a regression fails instead of hanging the machine.
"""

from __future__ import annotations

import pytest
import torch

from trainer.transport.bench import BenchConfig, run

pytestmark = pytest.mark.gpu


def _need_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot put two ranks on one GPU: needs 2 GPUs")


@pytest.mark.timeout(300)
def test_nccl_randomized_order_completes_20_rounds_in_a_row():
    _need_two_gpus()
    config = BenchConfig(sizes=(4096, 1 << 20, 8 << 20), transports=("nccl",), device="cuda", credits=2,
                         rounds=20, random_order=True, timeout_s=30.0, seed=11)
    report = run(config)
    assert [r["round"] for r in report] == list(range(20))


@pytest.mark.timeout(300)
def test_nccl_bench_measures_against_raw_send_recv():
    _need_two_gpus()
    config = BenchConfig(sizes=(8 << 20,), transports=("nccl",), device="cuda", repeats=2, timeout_s=30.0)
    rows = {r["name"]: r for r in run(config)}
    assert set(rows) == {"nccl", "send/recv", "peer copy"}
    for name in ("nccl", "send/recv"):
        assert rows[name]["one_way_us"] > 0 and rows[name]["busy_one_way_us"] > 0, rows[name]
    print("nccl / raw send/recv at 8 MiB:", rows["nccl"]["bandwidth_gbs"] / rows["send/recv"]["bandwidth_gbs"])
