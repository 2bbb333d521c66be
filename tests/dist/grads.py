"""Compare the gradients dumped by tests.dist.train_harness against the single-process reference."""

from __future__ import annotations

from pathlib import Path

import torch

GRAD_RTOL = 1e-4
"""Max |g - g_ref| allowed, relative to max |g_ref| of the same tensor (fp32; summation order differs)."""


def tp_slice(full: torch.Tensor, name: str, dim: int, tp_rank: int, tp: int, gated: bool = False) -> torch.Tensor:
    """This TP rank's part of a full (TP=1) tensor. A gated MLP's (--swiglu) fc1 is [gate; up] in the
    full model but [gate shard; up shard] on each TP rank (megatron-core's layout), so its two halves are
    sliced apart; every other partitioned tensor is the tp_rank-th chunk along its partition dim."""
    if dim < 0 or tp == 1:
        return full
    if gated and ".mlp.linear_fc1." in name and dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=dim)[tp_rank]


def load_rank_grads(folder: Path, iteration: int) -> dict[int, dict]:
    return {int(p.name.split("_rank")[1].split("_")[0]): torch.load(p)
            for p in sorted(folder.glob(f"grads_rank*_it{iteration}.pt"))}


def compare_grads(reference: dict, ranks: dict[int, dict]) -> tuple[float, list[str]]:
    """(worst relative error, problems). Every reference parameter must appear on some rank."""
    seen, problems, worst = set(), [], 0.0
    for rank, grads in ranks.items():
        for name, (grad, dim, tp_rank, tp, *gated) in grads.items():
            if name not in reference:
                problems.append(f"rank {rank}: {name} not in the reference model")
                continue
            expected = reference[name][0]
            expected = tp_slice(expected, name, dim, tp_rank, tp, bool(gated and gated[0]))
            if expected.shape != grad.shape:
                problems.append(f"rank {rank}: {name} shape {tuple(grad.shape)} != {tuple(expected.shape)}")
                continue
            scale = expected.abs().max().item() or 1.0
            err = (grad - expected).abs().max().item() / scale
            worst = max(worst, err)
            if err > GRAD_RTOL:
                problems.append(f"rank {rank}: {name} differs by {err:.2e} (relative to max |g_ref|)")
            seen.add(name)
    missing = sorted(set(reference) - seen)
    if missing:
        problems.append(f"reference parameters no rank holds: {missing}")
    return worst, problems
