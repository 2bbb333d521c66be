"""A resumed run must match its checkpoint's seed, LR schedule, batch and model.

Before: --load took whatever the folder held; a second experiment with another seed and learning
rate silently continued the first one's optimizer and scheduler state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.dist.checkpoints import TRACKER
from tests.dist.launch import launch
from tests.model_flags import model_flags

ARGS = [*model_flags(), "--micro-batch-size", "2", "--global-batch-size", "4"]


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


def _lr_at(output: str, iteration: int) -> float:
    for line in output.splitlines():
        if f"iteration {iteration:8d}/" in line:
            return float(line.split("learning rate:")[1].split("|")[0])
    raise AssertionError(f"no iteration {iteration} line in:\n{output[-3000:]}")


@pytest.mark.timeout(900)
def test_megatron_lm_load_flags(tmp_path: Path) -> None:
    """Megatron-LM's own ways to resume with other settings: the LR schedule from the command line
    (--override-opt_param-scheduler) or from the checkpoint (--use-checkpoint-opt_param-scheduler),
    weights only (--finetune), no optimizer / RNG state (--no-load-optim / --no-load-rng)."""
    ckpt = tmp_path / "ckpt"
    first = train(ckpt, "--train-iters", "2", "--lr-decay-style", "linear")  # decays to 0 over 2 iterations
    assert first.returncode == 0, first.output[-3000:]
    longer = ("--train-iters", "4", "--lr-decay-style", "linear")
    refused = train(ckpt, *longer)
    assert refused.returncode == 1 and "--override-opt_param-scheduler" in refused.output, refused.output[-3000:]
    for flag, lr in (("--override-opt_param-scheduler", 5e-4),  # this line's 4-iteration decay: 1e-3 x (1 - 2/4)
                     ("--use-checkpoint-opt_param-scheduler", 0.0)):  # the checkpoint's: over after 2
        copy = tmp_path / flag.strip("-")
        shutil.copytree(ckpt, copy)
        run = train(copy, *longer, flag)
        assert run.returncode == 0 and "resuming at iteration 2" in run.output, run.output[-3000:]
        assert _lr_at(run.output, 3) == pytest.approx(lr, abs=1e-12), flag
    copy = tmp_path / "finetune"
    shutil.copytree(ckpt, copy)
    tuned = train(copy, "--train-iters", "2", "--seed", "7", "--lr", "5e-4", "--finetune")
    assert tuned.returncode == 0, tuned.output[-3000:]
    assert "for --finetune: training starts at iteration 0" in tuned.output and "resuming at iteration 0" in tuned.output
    assert _lr_at(tuned.output, 1) == pytest.approx(5e-4)
    copy = tmp_path / "no-load-optim"
    shutil.copytree(ckpt, copy)
    bare = train(copy, *longer, "--no-load-optim", "--no-load-rng")
    assert bare.returncode == 0 and "resuming at iteration 2" in bare.output, bare.output[-3000:]
    assert "without its optimizer and LR scheduler state (--no-load-optim)" in bare.output
