"""The DPP runtime: a schedule policy executed over stage-to-stage links (docs/training.md#the-dpp-runtime-trainerpipelinedpppy)."""

from trainer.pipeline.dpp import DppContext, forward_backward_dpp, make_forward_backward_func
from trainer.pipeline.stall import DppStallError

__all__ = ["DppContext", "DppStallError", "forward_backward_dpp", "make_forward_backward_func"]
