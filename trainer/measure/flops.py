"""Model FLOPs per iteration as Megatron-LM counts them, for ``--log-throughput``.

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
"""

from __future__ import annotations

from trainer.config import TrainConfig


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
