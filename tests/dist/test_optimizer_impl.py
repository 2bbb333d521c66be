"""--torch-optimizer-impl fused through the trainer: megatron-core's optimizer (torch's AdamW, no TE or Apex
here) steps with torch's fused kernel in a real 2-rank PP=2 --use-dpp run, and trains to the default
(foreach) run's losses -- the same maths without the temporaries (trainer/session/optimizer_impl.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags

ARGS = [*model_flags(), "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
        "--pipeline-model-parallel-size", "2", "--use-dpp", "--lr", "1e-2", "--weight-decay", "0.1",
        "--dpp-timeout", "120", "--log-interval", "1"]


def _run(out: Path, flags: list[str]) -> tuple[dict, str]:
    results = launch(["tests.dist.train_harness", "--out", str(out), "--", *ARGS, *flags], 2, timeout_s=240)
    check_ok(results)
    return json.loads((out / "losses_rank1.json").read_text()), "".join(r.output for r in results)


@pytest.mark.timeout(600)
def test_the_fused_torch_step_trains_to_the_default_step_s_losses(tmp_path: Path) -> None:
    default, default_log = _run(tmp_path / "foreach", [])
    fused, fused_log = _run(tmp_path / "fused", ["--torch-optimizer-impl", "fused"])
    assert "torch's fused step" not in default_log
    assert fused_log.count("optimizer: torch's fused step in") == 2, fused_log[-3000:]  # each stage's optimizer
    assert sorted(fused, key=int) == sorted(default, key=int) == ["1", "2", "3", "4"]
    for it, losses in default.items():
        assert fused[it]["lm loss"] == pytest.approx(losses["lm loss"], rel=1e-5), it
    assert fused["4"]["lm loss"] != default["1"]["lm loss"]  # the steps moved the weights


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("saved_with", "resumed_with", "optimizer"),
                         [("foreach", "fused", ()), ("fused", "foreach", ("--use-distributed-optimizer",))],
                         ids=["foreach-to-fused", "fused-to-foreach-distopt"])
def test_a_checkpoint_resumes_with_the_other_step(tmp_path: Path, saved_with: str, resumed_with: str,
                                                  optimizer: tuple[str, ...]) -> None:
    """The restored param groups and step counts are the saving run's; the resumed run steps with its own
    implementation (its log says so) and continues the straight run within the equivalence tolerance."""
    from tests.dist.test_checkpoint_layouts import LOSS_RTOL, straight_run_with_checkpoint_at_3, train

    straight, ckpt = straight_run_with_checkpoint_at_3(tmp_path, 1, *optimizer, "--torch-optimizer-impl", saved_with)
    resumed, output = train(tmp_path / "resumed", 1, *optimizer, "--torch-optimizer-impl", resumed_with,
                            "--load", str(ckpt))
    assert "resuming at iteration 3" in output and sorted(resumed) == [4, 5, 6], output[-3000:]
    assert ("optimizer: torch's fused step in" in output) == (resumed_with == "fused")
    assert ("the restored state steps with torch's fused step" in output) == (resumed_with == "fused")
    for it in (4, 5, 6):
        assert resumed[it] == pytest.approx(straight[it], rel=LOSS_RTOL), (it, resumed[it], straight[it])
