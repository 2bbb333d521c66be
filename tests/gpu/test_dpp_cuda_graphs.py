"""--dpp-cuda-graphs on CUDA: the same losses and gradients as the eager DPP run.

Two pipeline stages; on a one-GPU machine both ranks share the GPU (--distributed-backend gloo, as
the DPP runtime's CUDA IPC path allows). fp32 and dropout 0, so graph replays and eager ops run the
same kernels on the same data: losses and gradients must agree to rounding. The graphed run must
really replay (its log counts the forwards each stage replayed) -- a run that silently fell back to
eager everywhere would pass the comparison and prove nothing.

    python -m pytest -m gpu tests/gpu/test_dpp_cuda_graphs.py -s
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.dist.launch import check_ok, launch

pytestmark = pytest.mark.gpu

ITERS = 3
M = 8
GPT = ["--device", "cuda", "--mock-data", "--num-layers", "4", "--hidden-size", "256",
       "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
       "--vocab-size", "1000", "--micro-batch-size", "2", "--global-batch-size", str(2 * M),
       "--pipeline-model-parallel-size", "2", "--lr", "1e-3", "--train-iters", str(ITERS),
       "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--use-dpp",
       "--dpp-timeout", "60", "--log-interval", "1"]
REPLAYED = re.compile(r"stage (\d+) chunk (\d+): (\d+) training forward\(s\) replayed from CUDA graphs, (\d+) eager")


def _run(out: Path, extra: list[str]) -> tuple[list, dict]:
    args = [*GPT, *extra]
    if torch.cuda.device_count() < 2:
        args += ["--distributed-backend", "gloo"]
    results = launch(["tests.dist.train_harness", "--out", str(out), "--dump-grads", "2", "--", *args], 2,
                     timeout_s=300)
    check_ok(results)
    return results, json.loads((out / "losses_rank1.json").read_text())


@pytest.mark.timeout(700)
@pytest.mark.parametrize("chunks", [1, 2], ids=["v1", "v2"])
def test_graphed_dpp_equals_eager_dpp(tmp_path: Path, chunks: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    layout = [] if chunks == 1 else ["--num-layers-per-virtual-pipeline-stage", "1"]
    _, eager = _run(tmp_path / "eager", layout)
    results, graphed = _run(tmp_path / "graphed", [*layout, "--dpp-cuda-graphs"])
    counts = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for r in results for m in REPLAYED.finditer(r.output)}
    print("replayed/eager forwards per (stage, chunk):", counts)
    # Every training forward of every chunk replays (a stage's in-flight cap is each chunk's number of slots).
    assert counts == {(s, c): (ITERS * M, 0) for s in range(2) for c in range(chunks)}, counts
    print("iteration  eager  graphed")
    for it in sorted(eager, key=int):
        print(it, eager[it]["lm loss"], graphed[it]["lm loss"])
        assert graphed[it]["lm loss"] == pytest.approx(eager[it]["lm loss"], rel=1e-5, abs=1e-6), f"iteration {it}"
    dumps = sorted(p.name for p in (tmp_path / "eager").glob("grads_rank*_it*.pt"))
    assert len(dumps) == 4, dumps  # 2 ranks x 2 iterations (--dump-grads 2)
    assert dumps == sorted(p.name for p in (tmp_path / "graphed").glob("grads_rank*_it*.pt"))
    for dump in dumps:
        want = torch.load(tmp_path / "eager" / dump)
        got = torch.load(tmp_path / "graphed" / dump)
        assert sorted(got) == sorted(want), dump
        for name, (grad, *_) in want.items():
            torch.testing.assert_close(got[name][0], grad, rtol=1e-4, atol=1e-6, msg=lambda m, d=dump, n=name: f"{d} {n}: {m}")
