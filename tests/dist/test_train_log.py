"""Megatron-LM's iteration-line fields a flag adds (``--log-throughput``), in a real one-process run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.dist.launch import REPO, free_port

TINY = ["--device", "cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "128", "--global-batch-size", "8", "--micro-batch-size", "2",
        "--train-iters", "2"]


def _iteration_lines(flags: list[str]) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "trainer.train", *TINY, *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "trainer.train: iteration " in line]


@pytest.mark.timeout(180)
def test_log_throughput_adds_megatrons_field_after_the_iteration_time() -> None:
    lines = _iteration_lines(["--log-throughput"])
    assert len(lines) == 2
    for line in lines:
        assert re.search(r"elapsed time per iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): "
                         r"\d+\.\d \| learning rate:", line), line
    assert all("throughput per GPU" not in line for line in _iteration_lines([]))
