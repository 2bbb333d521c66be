"""``python -m trainer.train`` refuses an impossible layout before creating any process group."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.dist.launch import REPO, free_port


@pytest.mark.timeout(60)
def test_bad_layout_exits_2_naming_every_value_before_any_process_group() -> None:
    # Rank 0 of a would-be 8-rank job, with nobody else around: had it tried to create the process
    # group it would wait for 7 peers (the store) instead of exiting at once.
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = ["--device", "cpu", "--mock-data", "--num-layers", "6", "--pipeline-model-parallel-size", "4",
            "--tensor-model-parallel-size", "3", "--num-attention-heads", "4", "--hidden-size", "64",
            "--global-batch-size", "3", "--micro-batch-size", "1"]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainer.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - start < 45
    for needle in ("world size 8 is not divisible by --tensor-model-parallel-size=3 x --pipeline-model-parallel-size=4",
                   "--num-layers=6 is not divisible by --pipeline-model-parallel-size=4",
                   "--num-attention-heads=4 is not divisible by --tensor-model-parallel-size=3",
                   "--ffn-hidden-size=256 is not divisible by --tensor-model-parallel-size=3"):
        assert needle in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.timeout(60)
def test_missing_launcher_port_is_one_clear_error() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODEID": "0"})
    proc = subprocess.run([sys.executable, "-m", "trainer.train", "--device", "cpu", "--mock-data"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert "MASTER_PORT is not set" in proc.stderr and "Traceback" not in proc.stderr
