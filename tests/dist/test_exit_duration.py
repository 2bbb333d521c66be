"""--exit-duration-in-mins (Megatron-LM's): once the run has lasted the limit, every rank stops after
the same iteration, a checkpoint is saved there and the run exits EXIT_STOPPED (75), as a signalled
stop does: an unfinished run never looks finished to a launcher (Megatron-LM itself exits 0 here).

The ranks run through tests/dist/train_harness.py with their start time moved STARTED_S_AGO seconds
back: the limit (whole minutes, as Megatron-LM's) is reached a few seconds into training, as it would
be after a minute, instead of both ranks training a real minute on the CI's two cores."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.dist.checkpoints import TRACKER, assert_megatron_checkpoint
from tests.dist.launch import launch
from tests.model_flags import model_flags
from trainer.train import EXIT_STOPPED

STARTED_S_AGO = 57  # the 1-minute limit is then reached ~3 s after the ranks' start (later under load)
ARGS = [*model_flags(), "--micro-batch-size", "1", "--global-batch-size", "2",
        "--pipeline-model-parallel-size", "2", "--train-iters", "1000000", "--log-interval", "1000"]


@pytest.mark.timeout(600)
def test_exit_duration_saves_and_stops_unfinished(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    results = launch(["tests.dist.train_harness", "--out", str(tmp_path / "harness"),
                      "--started-seconds-ago", str(STARTED_S_AGO), "--",
                      *ARGS, "--save", str(ckpt), "--exit-duration-in-mins", "1"], 2, timeout_s=400)
    output = "\n".join(r.output for r in results)
    assert [r.returncode for r in results] == [EXIT_STOPPED, EXIT_STOPPED], output[-3000:]
    found = re.search(r"exiting program after (\S+) minutes \(--exit-duration-in-mins 1, the longest-running rank\) at iteration (\d+)", output)
    assert found and float(found.group(1)) >= 1.0, output[-3000:]  # printed to 0.01 min
    iteration = int(found.group(2))
    assert 0 < iteration < 1000000
    assert (ckpt / TRACKER).read_text().strip() == str(iteration)
    assert_megatron_checkpoint(ckpt, iteration)
