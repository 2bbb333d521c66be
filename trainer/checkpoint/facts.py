"""What save and load need to know about a run besides its model and optimizer (trainer.train fills it
in; trainer/checkpoint/state.py and megatron_lm.py read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunFacts:
    """What save and load need to know about this run besides the model and optimizer."""

    layout: dict[str, int]
    """world_size, tp, pp, vp (no rank: common.pt is the same on every rank)."""
    padded_vocab_size: int
    use_distributed_optimizer: bool
    identity: dict[str, object]
    precision: str = "fp32"
    """"fp16", "bf16" or "fp32": which megatron-core optimizer wraps the parameters (Float16Optimizer or
    FP32Optimizer), whose state a Megatron-LM checkpoint must share to be loaded."""
