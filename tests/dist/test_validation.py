"""``--split`` / ``--eval-interval`` / ``--eval-iters``: validation through the DPP runtime's
forward-only steps prints Megatron-LM's validation lines with the values a single-process reference
(plain sequential loop, same weights, see tests/dist/train_harness.py) prints."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags

RTOL = 1e-5
TINY = [*model_flags(model="gpt", layers=4), "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--lr", "1e-3", "--dpp-timeout", "120",
        "--split", "8,1,1", "--eval-interval", "2", "--eval-iters", "2"]
VALIDATION = re.compile(r"trainer\.train:  validation loss at iteration (\d+) \| lm loss value: (\S+) \| "
                        r"lm loss PPL: (\S+) \| $")


def _run(out: Path, world: int, flags: list[str], harness: list[str]) -> tuple[dict[int, tuple[float, float]], dict]:
    results = launch(["tests.dist.train_harness", "--out", str(out), *harness, "--", *TINY, *flags], world,
                     timeout_s=300)
    check_ok(results)
    found: dict[int, tuple[float, float]] = {}
    for rank in range(world):
        lines = results[rank].output.splitlines()
        for i, line in enumerate(lines):
            match = VALIDATION.search(line)
            if match:
                assert rank == world - 1, f"rank {rank} printed a validation line: {line}"
                rule = len(line.split("trainer.train: ", 1)[1]) + 1
                assert lines[i - 1].endswith("-" * rule) and lines[i + 1].endswith("-" * rule), lines[i - 1:i + 2]
                found[int(match.group(1))] = (float(match.group(2)), float(match.group(3)))
    losses = json.loads((out / f"losses_rank{world - 1}.json").read_text())
    return found, losses


@pytest.mark.timeout(600)
def test_validation_lines_through_dpp_equal_the_single_process_reference(tmp_path: Path) -> None:
    ref, ref_losses = _run(tmp_path / "ref", 1, [], ["--reference", "--save-init", str(tmp_path / "init.pt")])
    dpp, dpp_losses = _run(tmp_path / "dpp", 2, ["--pipeline-model-parallel-size", "2", "--use-dpp"],
                           ["--load-init", str(tmp_path / "init.pt")])
    assert sorted(ref) == sorted(dpp) == [2, 4], (ref, dpp)
    for iteration, (loss, ppl) in ref.items():
        assert dpp[iteration][0] == pytest.approx(loss, rel=RTOL), (iteration, dpp, ref)
        assert dpp[iteration][1] == pytest.approx(ppl, rel=RTOL * 10)
        assert ppl == pytest.approx(math.exp(loss), rel=1e-6)
    assert ref[2][0] != ref[4][0]  # another model and other valid samples at iteration 4
    # Validation leaves training alone: the training losses still match the reference's.
    for iteration, values in ref_losses.items():
        assert dpp_losses[iteration]["lm loss"] == pytest.approx(values["lm loss"], rel=RTOL)
