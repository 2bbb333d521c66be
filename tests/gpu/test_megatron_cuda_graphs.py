"""--cuda-graph-impl local (megatron-core's own per-layer CUDA graphs, Megatron-LM's flag) on CUDA: the
same losses and gradients as the eager megatron-core run, and the graphs really replay.

This is the bench's ``megatron-1f1b-graphs`` line: the fair bar for --dpp-cuda-graphs, since a Megatron
user can switch graphs on too. fp32 and dropout 0, so replays and eager ops run the same kernels on the
same data. PP=1 (megatron-core's no-pipelining schedule): under its pipeline schedule (PP=4, 4xH100,
megatron-core 0.19.2 without Transformer Engine) the graphs failed to build, and the trainer refuses
--cuda-graph-impl local at PP > 1 (tests/unit/test_cuda_graphs.py).

    python -m pytest -m gpu tests/gpu/test_megatron_cuda_graphs.py -s
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.dist.launch import check_ok, launch

pytestmark = pytest.mark.gpu

ITERS = 4
M = 4
GPT = ["--device", "cuda", "--mock-data", "--num-layers", "4", "--hidden-size", "256",
       "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
       "--vocab-size", "1000", "--micro-batch-size", "2", "--global-batch-size", str(2 * M),
       "--lr", "1e-3", "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0",
       "--seed", "1234", "--log-interval", "1"]
CREATED = re.compile(r"stage (\d+): megatron-core CUDA graphs created for (\d+) of (\d+) layer runner")


def _run(out: Path, pp: int, extra: list[str]) -> tuple[list, dict]:
    args = [*GPT, "--pipeline-model-parallel-size", str(pp), *extra]
    results = launch(["tests.dist.train_harness", "--out", str(out), "--dump-grads", str(ITERS), "--", *args],
                     pp, timeout_s=300)
    check_ok(results)
    return results, json.loads((out / f"losses_rank{pp - 1}.json").read_text())


@pytest.mark.timeout(700)
def test_megatron_graphs_equal_eager_megatron(tmp_path: Path) -> None:
    pp = 1
    _, eager = _run(tmp_path / "eager", pp, [])
    results, graphed = _run(tmp_path / "graphed", pp, ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "1"])
    created = {int(m[1]): (int(m[2]), int(m[3])) for r in results for m in CREATED.finditer(r.output)}
    print("graphs created / layer runners per stage:", created)
    assert sorted(created) == list(range(pp)), created
    for stage, (made, runners) in created.items():
        assert runners > 0 and made == runners, f"stage {stage}: {made} of {runners} runners graphed"
    print("iteration  eager  graphed")
    for it in sorted(eager, key=int):
        print(it, eager[it]["lm loss"], graphed[it]["lm loss"])
        assert graphed[it]["lm loss"] == pytest.approx(eager[it]["lm loss"], rel=1e-5, abs=1e-6), f"iteration {it}"
    dumps = sorted(p.name for p in (tmp_path / "eager").glob("grads_rank*_it*.pt"))
    assert dumps and dumps == sorted(p.name for p in (tmp_path / "graphed").glob("grads_rank*_it*.pt"))
    for dump in dumps:
        want, got = torch.load(tmp_path / "eager" / dump), torch.load(tmp_path / "graphed" / dump)
        assert sorted(got) == sorted(want), dump
        for name, (grad, *_) in want.items():
            torch.testing.assert_close(got[name][0], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, d=dump, n=name: f"{d} {n}: {m}")
