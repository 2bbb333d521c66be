"""What the GPU equivalence tests share: train through tests.dist.train_harness, and hold a graphed run's
gradient dumps to its eager twin's, tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist.launch import check_ok, launch


def train(out: Path, world: int, args: list[str], last_rank: int) -> tuple[list, dict]:
    """(each rank's result, ``last_rank``'s losses by iteration) of one harness run with gradient dumps."""
    results = launch(["tests.dist.train_harness", "--out", str(out), *args], world, timeout_s=300)
    check_ok(results)
    return results, json.loads((out / f"losses_rank{last_rank}.json").read_text())


def assert_same_losses(eager: dict, graphed: dict) -> None:
    """Every iteration's loss within rel 1e-5 / abs 1e-6 (printed side by side)."""
    print("iteration  eager  graphed")
    for it in sorted(eager, key=int):
        print(it, eager[it]["lm loss"], graphed[it]["lm loss"])
        assert graphed[it]["lm loss"] == pytest.approx(eager[it]["lm loss"], rel=1e-5, abs=1e-6), f"iteration {it}"


def grad_dumps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("grads_rank*_it*.pt"))


def assert_same_grads(eager: Path, graphed: Path) -> None:
    """Both runs dumped the same files and parameters, every gradient within rtol 1e-4 / atol 1e-6."""
    dumps = grad_dumps(eager)
    assert dumps == grad_dumps(graphed)
    for dump in dumps:
        want, got = torch.load(eager / dump), torch.load(graphed / dump)
        assert sorted(got) == sorted(want), dump
        for name, (grad, *_) in want.items():
            torch.testing.assert_close(got[name][0], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, d=dump, n=name: f"{d} {n}: {m}")
