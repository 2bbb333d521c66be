"""The benchmark end to end on two processes (small sizes: it checks the plumbing, not speed)."""

from __future__ import annotations

import pytest

from trainer.transport.bench import BenchConfig, run


@pytest.mark.timeout(120)
def test_bench_measures_every_transport_and_baseline():
    config = BenchConfig(sizes=(4096, 1 << 20), transports=("shm", "gloo"), repeats=1, slot_bytes=512 << 10)
    rows = run(config)
    names = {(r["name"], r["size"]) for r in rows}
    assert names == {(n, s) for n in ("shm", "gloo", "send/recv", "memcpy") for s in config.sizes}
    assert all(r["bandwidth_gbs"] > 0 and r["latency_us"] > 0 for r in rows), rows
