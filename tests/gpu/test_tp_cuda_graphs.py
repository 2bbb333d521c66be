"""--dpp-cuda-graphs with tensor parallelism: the TP collectives (all-reduce; all-gather and
reduce-scatter under --sequence-parallel) captured inside the slot graphs give the same losses and
gradients as the eager DPP run.

NCCL needs a GPU per rank (gloo's collectives run on the host and cannot be captured), so these
tests need 2 GPUs (TP=2, one stage: one slot graph's forward and backward with the block's TP
collectives) or 4 (PP=2 x TP=2, with sequence parallelism and with dpp-zb, each TP pair replaying
the same slot's graph in the same order). fp32 and dropout 0: replays and eager ops run the same
kernels on the same data, so losses and gradients agree to rounding; the graphed run must replay.

    python -m pytest -m gpu tests/gpu/test_tp_cuda_graphs.py -s
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.gpu.same_run import assert_same_grads, assert_same_losses, train
from tests.model_flags import GPU_SMALL, model_flags

pytestmark = pytest.mark.gpu

ITERS = 3
M = 8
GPT = [*model_flags(**GPU_SMALL), "--micro-batch-size", "2", "--global-batch-size", str(2 * M),
       "--lr", "1e-3", "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0",
       "--seed", "1234", "--use-dpp", "--dpp-timeout", "60", "--log-interval", "1",
       "--distributed-backend", "nccl"]
REPLAYED = re.compile(r"stage (\d+) chunk (\d+): (\d+) training forward\(s\) replayed from CUDA graphs, (\d+) eager")
FREED = re.compile(r"rank (\d+): (\d+) CUDA graph\(s\) freed before the process groups")
SP = ["--sequence-parallel"]
VARLEN = ["--variable-seq-lengths", "--mock-seq-len-dist", "lognormal:0.6", "--seq-length-divisible-by", "32"]


def _compare(tmp_path: Path, pp: int, tp: int, layout: list[str]) -> None:
    world = pp * tp
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    base = [*GPT, "--pipeline-model-parallel-size", str(pp), "--tensor-model-parallel-size", str(tp), *layout]
    _, eager = train(tmp_path / "eager", world, ["--dump-grads", "2", "--", *base, "--dpp-eager"],
                     last_rank=world - 1)
    results, graphed = train(tmp_path / "graphed", world, ["--dump-grads", "2", "--", *base, "--dpp-cuda-graphs"],
                             last_rank=world - 1)
    counts = [(int(m[1]), int(m[2]), int(m[3]), int(m[4])) for r in results for m in REPLAYED.finditer(r.output)]
    print("(stage, chunk, replayed, eager) per rank:", counts)
    # every rank of every stage logs its count: all forwards replayed, TP peers alike
    assert sorted(counts) == sorted((s, 0, ITERS * M, 0) for s in range(pp) for _ in range(tp)), counts
    # every rank destroyed its graphs before its process groups (else ncclCommDestroy waits for ever on a
    # graph holding a captured TP collective) and exited 0 (train() checked the exit codes)
    freed = sorted((int(m[1]), int(m[2])) for r in results for m in FREED.finditer(r.output))
    print("(rank, graphs freed) per rank:", freed)
    assert [rank for rank, _ in freed] == list(range(world)) and all(n > 0 for _, n in freed), freed
    assert_same_losses(eager, graphed)
    assert_same_grads(tmp_path / "eager", tmp_path / "graphed")


@pytest.mark.timeout(700)
@pytest.mark.parametrize("layout", [["--dpp-policy", "dpp"], ["--dpp-policy", "dpp", *SP],
                                    ["--dpp-policy", "dpp", *SP, *VARLEN]],
                         ids=["tp2", "tp2-sp", "tp2-sp-varlen"])
def test_tp2_slot_graphs_equal_eager(tmp_path: Path, layout: list[str]) -> None:
    """One stage, TP=2: the block's forward and backward graphs hold its TP collectives (tp2-sp: the
    sequence-parallel all-gathers and reduce-scatters, input and output [s/2, b, h]; tp2-sp-varlen: a
    graph pair per bucket length 32..128, each slot's input [length/2, b, h])."""
    _compare(tmp_path, 1, 2, layout)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [["--dpp-policy", "dpp", *SP], ["--dpp-policy", "dpp-zb"]],
                         ids=["sp", "dpp-zb"])
def test_pp2_tp2_graphs_equal_eager(tmp_path: Path, layout: list[str]) -> None:
    """PP=2 x TP=2: both TP pairs replay their slots' graphs in the order their leader decided (sp:
    activations cross the stage boundary as [s/2, b, h] shards; dpp-zb: stage 1's slots hold F, I and
    W graphs, the W graphs replayed in the leader's order too)."""
    _compare(tmp_path, 2, 2, layout)
