"""megatron-core models (GPT, BERT) built per pipeline stage and virtual chunk, with their steps."""

from trainer.model.build import build_model_chunks, transformer_config, wrap_ddp
from trainer.model.steps import make_forward_step

__all__ = ["build_model_chunks", "make_forward_step", "transformer_config", "wrap_ddp"]
