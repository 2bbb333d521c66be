"""Megatron-LM's iteration-line fields (``--log-throughput``, batch size, loss scale, skipped/nan counts),
in real one-process runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.dist.launch import REPO, free_port
from tests.model_flags import model_flags

TINY = [*model_flags(), "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", "2"]


def _iteration_lines(flags: list[str], script: str | None = None) -> list[str]:
    return [line for line in _stdout(flags, script).splitlines() if "trainer.train: iteration " in line]


def _stdout(flags: list[str], script: str | None = None) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    command = ["-c", script] if script else ["-m", "trainer.train"]
    proc = subprocess.run([sys.executable, *command, *TINY, *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(180)
def test_first_line_says_whether_graphs_run_and_why() -> None:
    """--use-dpp alone picks CUDA graphs where they can run; on CPU they cannot, and the run's first line
    says the schedule, that it is eager and why (trainer.config.plan.resolve_cuda_graphs)."""
    out = _stdout(["--use-dpp"])
    first = next(line for line in out.splitlines() if "trainer.train: run " in line)
    assert "| schedule dpp (--dpp-policy auto: without CUDA graphs dpp-zb was not measured faster); eager: " \
           "--dpp-cuda-graphs needs --device cuda (got cpu) |" in first, first


@pytest.mark.timeout(180)
def test_log_throughput_adds_megatrons_field_after_the_iteration_time() -> None:
    lines = _iteration_lines(["--log-throughput"])
    assert len(lines) == 2
    for line in lines:
        assert re.search(r"elapsed time per iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): "
                         r"\d+\.\d \| learning rate:", line), line
    assert all("throughput per GPU" not in line for line in _iteration_lines([]))


# Iteration 2 (hook argument 1) ends with inf gradients and NaN weights: its optimizer step is skipped
# (--fp16's overflow check) and every later loss is NaN, so iterations 3 and 4 are skipped NaN ones.
POISON = r"""
import sys
from trainer.train import TrainHooks, main

def poison(iteration, chunks):
    if iteration == 1:
        for chunk in chunks:
            for param in chunk.parameters():
                param.data.fill_(float("nan"))
                if getattr(param, "main_grad", None) is not None:
                    param.main_grad.fill_(float("inf"))
sys.exit(main(sys.argv[1:], TrainHooks(after_backward=poison)))
"""


@pytest.mark.timeout(180)
def test_iteration_line_has_megatrons_batch_loss_scale_and_skipped_nan_counts() -> None:
    lines = _iteration_lines(["--fp16", "--train-iters", "4", "--log-interval", "2"], script=POISON)
    assert len(lines) == 2
    for line in lines:
        assert re.search(r"learning rate: \S+ \| global batch size:     8 \| lm loss: \S+ \| loss scale: \d+\.\d \| "
                         r"grad norm: \S+ \| number of skipped iterations: +\d+ \| number of nan iterations: +\d+ \|",
                         line), line
    # Counted per log interval, as Megatron-LM: the second line covers iterations 3 and 4 only.
    assert "number of skipped iterations:   2 | number of nan iterations:   2 |" in lines[1], lines[1]


@pytest.mark.timeout(180)
def test_tensorboard_dir_holds_the_training_and_validation_loss(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = _iteration_lines(["--tensorboard-dir", str(tmp_path / "tb"), "--eval-interval", "2", "--eval-iters", "1"])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("lm loss", "learning-rate", "grad-norm", "loss-scale", "lm loss validation"):
        assert tag in scalars, scalars
    loss = events.Scalars("lm loss")
    assert [e.step for e in loss] == [1, 2]
    assert f"lm loss: {loss[1].value:.6E}" in lines[1]
    assert [e.step for e in events.Scalars("lm loss validation")] == [2]
