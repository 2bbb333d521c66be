"""A resumed run must match its checkpoint's seed, LR schedule, batch and model (issue 15, item 2).

Before: --load took whatever the folder held; a second experiment with another seed and learning
rate silently continued the first one's optimizer and scheduler state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.checkpoints import TRACKER
from tests.dist.launch import launch

ARGS = ["--device", "cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4"]


def train(ckpt: Path, *extra: str):
    return launch(["trainer.train", *ARGS, "--save", str(ckpt), "--load", str(ckpt), *extra], 1, timeout_s=300)[0]


@pytest.mark.timeout(900)
def test_resume_with_other_settings_is_refused_unless_overridden(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = train(ckpt, "--train-iters", "2", "--seed", "1", "--lr", "1e-3", "--lr-decay-iters", "10")
    assert first.returncode == 0, first.output[-3000:]
    refused = train(ckpt, "--train-iters", "4", "--seed", "2", "--lr", "5e-4", "--lr-decay-iters", "10")
    assert refused.returncode == 1, refused.output[-3000:]
    assert "belongs to a run with other settings (seed: checkpoint 1, this run 2; lr: checkpoint 0.001, " \
           "this run 0.0005)" in refused.output
    assert (ckpt / TRACKER).read_text().strip() == "2"  # nothing trained, nothing saved
    same = train(ckpt, "--train-iters", "3", "--seed", "1", "--lr", "1e-3", "--lr-decay-iters", "10")
    assert same.returncode == 0 and "resuming at iteration 2" in same.output, same.output[-3000:]
    forced = train(ckpt, "--train-iters", "4", "--seed", "2", "--lr", "1e-3", "--lr-decay-iters", "10",
                   "--override-checkpoint-config")
    assert forced.returncode == 0 and "despite other settings" in forced.output, forced.output[-3000:]
