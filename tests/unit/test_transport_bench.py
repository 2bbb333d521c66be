"""The benchmark CLI's pure parts: size parsing, settings validation, the ratio table."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.transport.bench import BenchConfig, _round_messages, format_size, format_table, parse_size


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
        BenchConfig(sizes=(0,), transports=("nccl",), device="cpu", repeats=0, credits=0, timeout_s=0, rounds=0)
    text = str(info.value)
    for bad in ("transports=['nccl']", "sizes=[0]", "repeats=0", "credits=0", "timeout_s=0", "rounds=0"):
        assert bad in text, text


def test_table_reports_one_way_busy_stream_and_ratios_against_both_baselines():
    config = BenchConfig(sizes=(1 << 20,), transports=("shm",))
    rows = [
        {"name": "shm", "size": 1 << 20, "one_way_us": 100.0, "bandwidth_gbs": 8.0, "busy_one_way_us": 120.0,
         "busy_bandwidth_gbs": 6.67, "stream_gbs": 9.0},
        {"name": "send/recv", "size": 1 << 20, "one_way_us": 400.0, "bandwidth_gbs": 2.0, "busy_one_way_us": 400.0,
         "busy_bandwidth_gbs": 2.0, "stream_gbs": 2.5},
        {"name": "memcpy", "size": 1 << 20, "one_way_us": 90.0, "bandwidth_gbs": 10.0, "busy_one_way_us": math.nan,
         "busy_bandwidth_gbs": math.nan, "stream_gbs": math.nan},
    ]
    lines = format_table(rows, config).splitlines()
    assert lines[1].split() == ["1M", "shm", "100.0", "8.00", "120.0", "6.67", "1.20", "9.00", "4.00", "0.80"]
    assert lines[3].split() == ["1M", "memcpy", "90.0", "10.00", "-", "-", "-", "-", "5.00", "-"]


def test_random_rounds_are_reproducible_and_within_credits():
    config = BenchConfig(sizes=(4096, 1 << 20), transports=("gloo",), credits=3, seed=5)
    plans = [_round_messages(config, r) for r in range(20)]
    assert plans == [_round_messages(config, r) for r in range(20)]
    assert all(len(sizes) <= 3 and set(sizes) <= {4096, 1 << 20} for p in plans for sizes in p.values())
    assert len({str(p) for p in plans}) > 1


def test_round_trip_receive_waits_for_the_payload_not_only_the_header() -> None:
    """The bench's receive must read ``msg.tensor``: that first read queues the stream's wait for the
    payload (trainer/transport/base.py). A receive that only releases the message times headers."""
    from trainer.transport.base import Message
    from trainer.transport.bench import _LinksPair
    from trainer.transport.tensors import header_for

    waited, released = [], []
    payload = torch.zeros(4)

    class Links:
        def wait_any(self, timeout: float) -> Message:
            message = Message(header_for(payload, "act", 0, 0), payload, source_rank=1)
            message.wait_when_used(lambda: waited.append(True))
            return message

        def release(self, message: Message) -> None:
            released.append(bool(waited))  # the wait came before the slot went back

    _LinksPair(Links(), timeout_s=1.0).recv(payload)
    assert waited == [True] and released == [True]
