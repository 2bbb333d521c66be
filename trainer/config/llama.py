"""Llama-family GPT models (RMSNorm, SwiGLU, RoPE, grouped-query attention, no linear biases): the
layout checks and the checkpoint identity of ModelConfig's Llama block, with Megatron-LM's rules (its
validate_args). The fields and their own checks (llama_problems) are ModelConfig's
(trainer/config/sections.py); the model is built from them in trainer/model/build.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config.sections import ModelConfig
    from trainer.config.training import TrainConfig


def llama_layout_problems(cfg: TrainConfig) -> list[str]:
    """The Llama-family flags against the parallel layout and the layer spec."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    p = []
    if m.group_query_attention and m.num_query_groups >= 1 and m.num_query_groups % tp:
        p.append(f"--num-query-groups={m.num_query_groups} is not divisible by --tensor-model-parallel-size={tp} "
                 "(each TP rank holds whole key/value groups)")
    if m.position_embedding_type == "rope" and (m.hidden_size // m.num_attention_heads) % 2:
        p.append(f"--position-embedding-type rope needs an even head size (--hidden-size / --num-attention-heads "
                 f"= {m.hidden_size // m.num_attention_heads})")
    return p


def llama_identity(m: ModelConfig) -> dict[str, object]:
    """The architecture a checkpoint of this model must share (trainer.checkpoint.state.run_identity)."""
    return {"normalization": m.normalization, "swiglu": m.swiglu, "add_bias_linear": not m.disable_bias_linear,
            "position_embedding_type": m.position_embedding_type,
            "num_query_groups": m.num_query_groups if m.group_query_attention else m.num_attention_heads}
