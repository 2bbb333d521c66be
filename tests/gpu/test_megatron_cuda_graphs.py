"""--cuda-graph-impl local (megatron-core's own per-layer CUDA graphs, Megatron-LM's flag) on CUDA: the
same losses and gradients as the eager megatron-core run, and the graphs really replay.

This is the bench's ``megatron-1f1b-graphs`` line: the fair bar for --dpp-cuda-graphs, since a Megatron
user can switch graphs on too. fp32 and dropout 0, so replays and eager ops run the same kernels on the
same data. PP=1 (megatron-core's no-pipelining schedule: one graph per layer, reused) and PP=2 (its
1F1B schedule: one graph per layer and microbatch, created in execution order). At PP > 1 graph
creation used to assert (``fwd_buffer_reuse_ref_count == 0`` in ``_create_cudagraphs``) because every
microbatch passed the layers the same cached causal-mask tensor; GPT's forward step now passes none
under these graphs (trainer.model.steps.causal_mask_from_attention; docs/benchmarks.md says why). PP=2
needs two GPUs: megatron-core's schedule runs only over NCCL.

    python -m pytest -m gpu tests/gpu/test_megatron_cuda_graphs.py -s
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.gpu.same_run import assert_same_grads, assert_same_losses, grad_dumps, train
from tests.model_flags import GPU_SMALL, model_flags

pytestmark = pytest.mark.gpu

ITERS = 4
M = 4
GPT = [*model_flags(**GPU_SMALL), "--micro-batch-size", "2", "--global-batch-size", str(2 * M),
       "--lr", "1e-3", "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0",
       "--seed", "1234", "--log-interval", "1"]
CREATED = re.compile(r"stage (\d+): megatron-core CUDA graphs created for (\d+) of (\d+) layer runner")


def _run(out: Path, pp: int, extra: list[str]) -> tuple[list, dict]:
    args = [*GPT, "--pipeline-model-parallel-size", str(pp), *extra]
    return train(out, pp, ["--dump-grads", str(ITERS), "--", *args], last_rank=pp - 1)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("pp", [1, 2], ids=["pp1", "pp2"])
def test_megatron_graphs_equal_eager_megatron(tmp_path: Path, pp: int) -> None:
    # megatron-core's schedule needs NCCL (over gloo the trainer runs its own policy): a GPU per stage.
    if torch.cuda.device_count() < pp:
        pytest.skip(f"needs {pp} GPU(s), {torch.cuda.device_count()} visible")
    _, eager = _run(tmp_path / "eager", pp, [])
    results, graphed = _run(tmp_path / "graphed", pp, ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "1"])
    created = {int(m[1]): (int(m[2]), int(m[3])) for r in results for m in CREATED.finditer(r.output)}
    print("graphs created / layer runners per stage:", created)
    assert sorted(created) == list(range(pp)), created
    for stage, (made, runners) in created.items():
        assert runners > 0 and made == runners, f"stage {stage}: {made} of {runners} runners graphed"
    assert_same_losses(eager, graphed)
    assert grad_dumps(tmp_path / "eager")
    assert_same_grads(tmp_path / "eager", tmp_path / "graphed")
