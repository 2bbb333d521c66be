"""Training on the shipped sample corpus: the loss drops over 50 iterations, and stopping at 20 and
resuming from the checkpoint reproduces the uninterrupted run's losses exactly (CPU, GPT PP=2, DPP).

Dropout is off here: the DPP runtime may run microbatches in a different order from run to run, so
dropout masks drawn from one generator would differ even without a restart (docs/training.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.corpus import GPT2_FILES
from tests.dist.checkpoints import assert_megatron_checkpoint
from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags


def _train(out: Path, data: str, iters: int, *extra: str) -> dict[int, float]:
    args = [*model_flags(hidden=64, seq=32, vocab=None, mock_data=False), "--data-path", data,
            "--tokenizer-type", "GPT2BPETokenizer", *GPT2_FILES,
            "--micro-batch-size", "2", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
            "--use-dpp", "--lr", "3e-3", "--lr-warmup-iters", "5", "--lr-decay-iters", "50",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(iters),
            # gloo links: the result must not depend on the transport, and this keeps the test off
            # /dev/shm, which concurrent test sessions on a shared machine clean up.
            "--transport", "gloo", "--log-interval", "10", *extra]
    check_ok(launch(["tests.dist.train_harness", "--out", str(out), "--", *args], 2, timeout_s=420))
    losses = json.loads((out / "losses_rank0.json").read_text())
    return {int(it): v["lm loss"] for it, v in losses.items()}


@pytest.mark.timeout(1500)
def test_loss_drops_and_resume_reproduces_straight_run(gpt2_corpus: str, tmp_path: Path) -> None:
    straight = _train(tmp_path / "straight", gpt2_corpus, 50)
    assert sorted(straight) == list(range(1, 51))
    first, last = sum(straight[i] for i in range(1, 6)) / 5, sum(straight[i] for i in range(46, 51)) / 5
    assert last < first - 1.0, f"loss did not drop: first five {first:.3f}, last five {last:.3f}"

    ckpt = tmp_path / "ckpt"
    part1 = _train(tmp_path / "part1", gpt2_corpus, 20, "--save", str(ckpt), "--save-interval", "20")
    assert_megatron_checkpoint(ckpt, 20)
    part2 = _train(tmp_path / "part2", gpt2_corpus, 50, "--load", str(ckpt))
    assert sorted(part2) == list(range(21, 51))  # resumed at 20, not from scratch
    assert {**part1, **part2} == straight  # exact: same samples, same weights, same optimizer state


@pytest.mark.timeout(360)
def test_load_of_missing_directory_starts_fresh(tmp_path: Path) -> None:
    args = [*model_flags(), "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--load", str(tmp_path / "nothing-here")]
    check_ok(launch(["tests.dist.train_harness", "--out", str(tmp_path), "--", *args], 1, timeout_s=300))
    assert sorted(json.loads((tmp_path / "losses_rank0.json").read_text())) == ["1", "2"]
