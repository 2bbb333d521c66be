"""The benchmark end to end on two processes (small sizes: it checks the plumbing, not speed)."""

from __future__ import annotations

import math

import pytest

from trainer.transport.bench import BenchConfig, run


@pytest.mark.timeout(180)
def test_bench_measures_every_transport_and_baseline():
    config = BenchConfig(sizes=(4096, 1 << 20), transports=("shm", "gloo"), repeats=1, slot_bytes=512 << 10)
    rows = run(config)
    names = {(r["name"], r["size"]) for r in rows}
    assert names == {(n, s) for n in ("shm", "gloo", "send/recv", "memcpy") for s in config.sizes}
    for r in rows:
        assert r["one_way_us"] > 0 and r["bandwidth_gbs"] > 0, r
        if r["name"] != "memcpy":  # the copy baseline has no busy or stream column
            assert r["busy_one_way_us"] > 0 and r["stream_gbs"] > 0, r
        else:
            assert math.isnan(r["busy_one_way_us"]), r


@pytest.mark.timeout(180)
def test_bench_random_order_completes_every_round():
    config = BenchConfig(sizes=(100, 4096, 300_000), transports=("shm", "gloo"), credits=2, rounds=6,
                         random_order=True, slot_bytes=512 << 10, seed=3)  # no chunking: see docs
    report = run(config)
    assert [(r["transport"], r["round"]) for r in report] == [(t, i) for t in ("shm", "gloo") for i in range(6)]
    assert sum(r["messages"] for r in report) > 0
