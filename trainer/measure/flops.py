"""Model FLOPs per iteration as Megatron-LM counts them, for ``--log-throughput``; and how they divide
between a layer's attention and its MLP, for a pipeline split inside a layer.

Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py) for a dense
transformer without MoE or MTP -- the models this trainer builds, grouped-query attention and SwiGLU
included. Per sample of s tokens, with L layers, hidden h, MLP width f, padded vocabulary V, n query
heads in g key/value groups (g = n without --group-query-attention), forward and backward (3 x the
forward's 2 FLOPs per multiply-add):

    12 L h f x (3/2 with --swiglu)      MLP (two GEMMs; a gated unit's fc1 is twice as wide)
  + 12 L h^2 (1 + g/n + s / (2h))       attention: Q/output and K/V projections, QK^T and attention x V
  + 6 h V                               output layer (logits)

The same count serves BERT, as in Megatron-LM (its heads are left out there too). With
--variable-seq-lengths s is --seq-length, Megatron-LM's figure: the padded maximum, not the tokens run.

:func:`layer_op_flops` splits a layer's term by op: a GEMM's forward, input gradient and weight
gradient cost the same; the core attention (QK^T, attention x V) has no weights, and its backward
computes two activation gradients per product, so it adds its forward's FLOPs once to F and twice to I.
Summed over F, I and W the two halves give the two layer terms above exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a type: a pipeline cost model imports this module without the configuration
    from trainer.config import TrainConfig
    from trainer.config.sections import ModelConfig

Ops = tuple[float, float, float]
"""(F, I, W) FLOPs: forward, input gradient, weight gradient."""


def layer_op_flops(hidden: int, seq_length: int, ffn_hidden: int, heads: int, query_groups: int | None = None,
                   swiglu: bool = False) -> tuple[Ops, Ops]:
    """FLOPs per token of one layer's attention half and of its MLP half, each as (F, I, W);
    ``query_groups`` None: one per head (no grouped-query attention)."""
    h, s = hidden, seq_length
    groups = heads if query_groups is None else query_groups
    projections = 4 * h * h * (1 + groups / heads)  # Q and output h x h; K and V h x (h g/n): forward
    core = 2 * h * s  # QK^T and attention x V, Megatron-LM's causal count (s / 2h of the h^2 term)
    mlp = 4 * h * ffn_hidden * (1.5 if swiglu else 1.0)
    return (projections + core, projections + 2 * core, projections), (mlp, mlp, mlp)


def attention_share(hidden: int, seq_length: int, ffn_hidden: int, heads: int, query_groups: int | None = None,
                    swiglu: bool = False) -> Ops:
    """The attention half's share of each of a layer's ops (F, I, W) by FLOPs (the MLP half has the rest)."""
    attention, mlp = layer_op_flops(hidden, seq_length, ffn_hidden, heads, query_groups, swiglu)
    return tuple(a / (a + m) for a, m in zip(attention, mlp, strict=True))


def model_attention_share(m: ModelConfig) -> Ops:
    """:func:`attention_share` of a configured model (the trainer's --ffn-hidden-size default, GQA, SwiGLU)."""
    return attention_share(*_dimensions(m))


def model_layer_attention_share(m: ModelConfig) -> float:
    """The attention half's share of a configured model's whole layer (F + I + W FLOPs together): what a
    split balances where only each stage's total time is known (a run's stage-balance fit)."""
    attention, mlp = layer_op_flops(*_dimensions(m))
    return sum(attention) / (sum(attention) + sum(mlp))


def _dimensions(m: ModelConfig) -> tuple:
    return (m.hidden_size, m.seq_length, m.ffn_size, m.num_attention_heads,
            m.num_query_groups if m.group_query_attention else None, m.swiglu)


def flops_per_iteration(cfg: TrainConfig, padded_vocab_size: int, global_batch_size: int | None = None) -> float:
    """Megatron-LM's model FLOPs of one iteration (the whole global batch, forward and backward);
    ``global_batch_size``: the iteration's (--rampup-batch-size), default --global-batch-size."""
    m = cfg.model
    layers, h, s = m.num_layers, m.hidden_size, m.seq_length
    groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
    per_token = (12 * layers * h * m.ffn_size * (1.5 if m.swiglu else 1.0)
                 + 12 * layers * h * h * (1 + groups / m.num_attention_heads + s / (2 * h))
                 + 6 * h * padded_vocab_size)
    return float((global_batch_size or cfg.optim.global_batch_size) * s * per_token)


def tflops_per_gpu(cfg: TrainConfig, padded_vocab_size: int, seconds: float, world_size: int,
                   global_batch_size: int | None = None) -> float:
    """Megatron-LM's ``throughput per GPU (TFLOP/s/GPU)``: model FLOPs / (time x 1e12 x world size)."""
    return flops_per_iteration(cfg, padded_vocab_size, global_batch_size) / (max(seconds, 1e-9) * 1e12 * world_size)
