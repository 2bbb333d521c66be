"""The static orders (1F1B, interleaved 1F1B, ZB-H1) replayed by the DPP runtime from CUDA graphs: the
same losses and gradients as the same order run eagerly, every forward replayed.

These are the benchmark's graphed static bars (1f1b-graphs, interleaved-graphs, zb-h1-graphs): same
graphs, slots and transport as the dynamic policies, only the order differs. A static order gets as
many slots per chunk as it holds activations at most (trainer.pipeline.runtime.graph_slots; ZB-H1
holds 2 on both stages at PP=2 where its 1F1B cap on stage 1 is 1), so no forward may run eagerly.
Two pipeline stages; on a one-GPU machine both ranks share the GPU over gloo (--distributed-backend
gloo, the DPP runtime's CUDA IPC path), as tests/gpu/test_dpp_cuda_graphs.py does. fp32, dropout 0.

    python -m pytest -m gpu tests/gpu/test_static_graphs.py -s
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.gpu.same_run import assert_same_grads, assert_same_losses, grad_dumps, train
from tests.gpu.test_dpp_cuda_graphs import GPT, ITERS, REPLAYED, M
from trainer.pipeline.runtime import graph_slots
from trainer.schedule.core import PipelineShape
from trainer.schedule.registry import make_policy

pytestmark = pytest.mark.gpu

SLOTS = re.compile(r"stage (\d+): CUDA graphs for chunk\(s\) \[[0-9, ]+\], ([0-9/]+) slot\(s\)")


def _run(out: Path, extra: list[str]) -> tuple[list, dict]:
    args = [*GPT, *extra]
    if torch.cuda.device_count() < 2:
        args += ["--distributed-backend", "gloo"]
    return train(out, 2, ["--dump-grads", "2", "--", *args], last_rank=1)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("policy, chunks", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_graphed_static_order_equals_its_eager_run(tmp_path: Path, policy: str, chunks: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    layout = ["--dpp-policy", policy] + ([] if chunks == 1 else ["--num-layers-per-virtual-pipeline-stage", "1"])
    _, eager = _run(tmp_path / "eager", [*layout, "--dpp-eager"])
    results, graphed = _run(tmp_path / "graphed", [*layout, "--dpp-cuda-graphs"])
    logs = "".join(r.output for r in results)
    counts = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for m in REPLAYED.finditer(logs)}
    print("replayed/eager forwards per (stage, chunk):", counts)
    assert counts == {(s, c): (ITERS * M, 0) for s in range(2) for c in range(chunks)}, counts
    shape = PipelineShape(2, M, chunks)
    slots = {int(m[1]): m[2] for m in SLOTS.finditer(logs)}
    assert slots == {s: "/".join(map(str, graph_slots(make_policy(policy, shape, s), shape, s))) for s in range(2)}, \
        logs[-3000:]
    if policy == "zb-h1":  # stage 1 holds more than its 1F1B cap: the log says so before capturing
        assert "stage 1: static zb-h1 holds up to 2 activation(s) per chunk (1F1B cap 1 in all)" in logs, logs[-3000:]
    assert_same_losses(eager, graphed)
    assert len(grad_dumps(tmp_path / "eager")) == 4  # 2 ranks x 2 iterations (--dump-grads 2)
    assert_same_grads(tmp_path / "eager", tmp_path / "graphed")
