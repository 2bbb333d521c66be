"""The benchmark CLI's pure parts: size parsing, settings validation, the ratio table."""

from __future__ import annotations

import pytest

from trainer.transport.bench import BenchConfig, format_size, format_table, parse_size


@pytest.mark.parametrize(("text", "value"), [("64K", 65536), ("1M", 1 << 20), ("256MiB", 256 << 20), ("1.5K", 1536), ("4096", 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value
    assert parse_size(format_size(value)) == value


@pytest.mark.parametrize("text", ["", "M", "-1M", "0", "12Q"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_config_names_every_bad_value():
    with pytest.raises(ValueError) as info:
        BenchConfig(sizes=(0,), transports=("nccl",), device="cpu", repeats=0, credits=0, timeout_s=0)
    text = str(info.value)
    for bad in ("transports=['nccl']", "sizes=[0]", "repeats=0", "credits=0", "timeout_s=0"):
        assert bad in text, text


def test_table_reports_ratios_against_both_baselines():
    config = BenchConfig(sizes=(1 << 20,), transports=("shm",))
    rows = [
        {"name": "shm", "size": 1 << 20, "bandwidth_gbs": 8.0, "latency_us": 100.0},
        {"name": "send/recv", "size": 1 << 20, "bandwidth_gbs": 2.0, "latency_us": 400.0},
        {"name": "memcpy", "size": 1 << 20, "bandwidth_gbs": 10.0, "latency_us": 90.0},
    ]
    shm_line = format_table(rows, config).splitlines()[1].split()
    assert shm_line == ["1M", "shm", "8.00", "100.0", "4.00", "0.80"]
