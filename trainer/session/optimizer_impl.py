"""Which of torch's implementations steps megatron-core's optimizer where megatron-core falls back to torch's
own Adam(W) / SGD (neither Transformer Engine nor Apex installed: the GPU machines here, every CPU run).

Why it matters: torch's default ("foreach") step allocates temporaries as large as all of a rank's fp32 main
parameters at once (AdamW's sqrt of exp_avg_sq; SGD's weight-decayed gradients): 1.32 GiB on the benchmark
model's stage 0. Under megatron-core's eager schedules they land in memory the step's activations just
freed, so the peak does not move; under the DPP runtime's CUDA graphs the activations live in the graphs'
private pools, the temporaries need memory of their own, and the run's peak reserved memory grows by them.
The "fused" step (one kernel per group, no temporaries) is what Megatron-LM users run anyway (Transformer
Engine's or Apex's FusedAdam). ``--torch-optimizer-impl`` (auto: fused on CUDA; trainer/config/optim.py)
picks it for every schedule alike."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

TORCH_STEPPERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""torch's optimizers with a fused step; megatron-core's fallback builds AdamW (as "adam") and SGD."""


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron-core optimizer (chained ones included)."""
    out = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", sub)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
    return out


def select_torch_impl(optimizer: Any, impl: str) -> int:
    """Make torch's own optimizers inside ``optimizer`` step with ``impl`` ("foreach": torch's default;
    "fused": one kernel per group); returns how many param groups step fused. Others (TE's or Apex's
    FusedAdam, already fused) are left alone.

    torch reads ``fused``/``foreach`` from each param group at every step, so the switch can be made at any
    time between steps, as long as each parameter's ``step`` count sits where that step keeps it: on the
    parameter's device (float32) when fused, on the CPU when not. Called once after the optimizer is built
    (no state yet) and again after a checkpoint load, whose param groups and step counts are the saving
    run's: a checkpoint saved with either implementation resumes with either."""
    if impl not in ("foreach", "fused"):
        raise ValueError(f"torch optimizer implementation {impl!r}: foreach or fused")
    fused = impl == "fused"
    switched = 0
    for inner in torch_optimizers(optimizer):
        if not isinstance(inner, TORCH_STEPPERS):
            continue
        for group in inner.param_groups:
            # foreach: both None, as megatron-core builds it (torch then picks its foreach kernels; fused=False
            # with foreach=None would be its one-tensor-at-a-time loop).
            group["fused"], group["foreach"] = (True, False) if fused else (None, None)
            switched += 1 if fused else 0
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor):
                    inner.state[param]["step"] = step.to(param.device if fused else "cpu", torch.float32)
    return switched


def pending_state_bytes(optimizer: Any) -> int:
    """Device bytes of optimizer state the first step will allocate: for every parameter without state
    yet, Adam's two moments (any optimizer named Adam: torch's, TE's or Apex's FusedAdam) or SGD's
    momentum buffer, in the parameter's dtype (the fp32 main weights, under --bf16 / --fp16). What the
    CUDA graph capture adds to the memory it measures (--dpp-held-cap fit), since the state does not
    exist until then; state restored by a checkpoint is already allocated and not counted."""
    total = 0
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            copies = 2 if "adam" in type(inner).__name__.lower() else 1 if group.get("momentum") else 0
            for param in group["params"]:
                if not inner.state.get(param):
                    total += copies * param.numel() * param.element_size()
    return total
