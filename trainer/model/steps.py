"""Megatron-style forward step functions: ``forward_step(data_iterator, model) -> (output, loss_func)``.

The iterator yields exactly one microbatch dict (the runtime hands each forward the data of *its*
microbatch). Losses follow Megatron's pretrain_gpt / pretrain_bert: token-mean masked LM loss
(+ sentence-order loss for BERT); the schedule divides by the number of microbatches.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def _gpt_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(output.float().reshape(-1) * mask) / mask.sum().clamp(min=1)
    # clone(): megatron-core's schedules divide the returned loss by num_microbatches IN PLACE, and a
    # bare detach() shares its storage, so the logged loss came out M times too small (seen on CUDA).
    return loss, {"lm loss": loss.detach().clone()}


def _gpt_token_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron's pretrain_gpt loss with per-token averaging: (summed loss, tokens, report). The
    schedule sums tokens over microbatches (and finalize_model_grads over DP) and scales gradients
    by 1 / total when config.calculate_per_token_loss; the report [sum, tokens] is reduced the same way."""
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(output.float().reshape(-1) * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.to(loss.dtype)])}


def gpt_forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_gpt_loss, batch["loss_mask"])


def gpt_token_forward_step(data_iterator, model):
    """gpt_forward_step returning Megatron's 3-tuple loss (for --variable-seq-lengths: padding makes
    token counts differ between microbatches, so a per-microbatch mean would misweight tokens)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_gpt_token_loss, batch["loss_mask"])


def _bert_loss(loss_mask: torch.Tensor, is_random: torch.Tensor, output):
    lm_losses, sop_logits = output
    mask = loss_mask.reshape(-1).float()
    lm_loss = torch.sum(lm_losses.float().reshape(-1) * mask) / mask.sum().clamp(min=1)
    sop_loss = F.cross_entropy(sop_logits.reshape(-1, 2).float(), is_random.reshape(-1))
    loss = lm_loss + sop_loss
    return loss, {"lm loss": lm_loss.detach(), "sop loss": sop_loss.detach()}


def bert_forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=batch["types"], lm_labels=batch["labels"])
    return output, partial(_bert_loss, batch["loss_mask"], batch["is_random"])


def causal_mask_from_attention(forward_step: Callable) -> Callable:
    """GPT's forward step with no attention mask (--cuda-graph-impl local): megatron-core's causal
    attention then applies its own cached causal mask (fused_softmax's default), the same values.

    Why: the collated causal mask is one cached tensor shared by every microbatch
    (trainer.model.batches.causal_mask), so to megatron-core's graph recorder it is one buffer that is
    an input of every layer's graph of every microbatch. Under its pipeline schedule (one graph per
    layer and microbatch, created in execution order) that buffer stays "in use" until the last
    microbatch's forward graph is captured, but 1F1B captures backward graphs before that, and
    _create_cudagraphs asserts ``fwd_buffer_reuse_ref_count == 0`` before each backward capture
    (docs/benchmarks.md, megatron-core's own CUDA graphs). Without a mask argument nothing is shared.
    Transformer Engine runs pass no mask for causal attention either."""

    def step(data_iterator, model):
        if data_iterator is None:
            return forward_step(data_iterator, model)
        batch = next(data_iterator)
        return forward_step(iter([{**batch, "attention_mask": None}]), model)

    return step


def make_forward_step(model_name: str, per_token_loss: bool = False) -> Callable:
    """``per_token_loss`` (GPT only, as in Megatron-LM: BERT's loss stays per microbatch): the
    3-tuple loss for megatron-core's calculate_per_token_loss."""
    if per_token_loss and model_name == "gpt":
        return gpt_token_forward_step
    return {"gpt": gpt_forward_step, "bert": bert_forward_step}[model_name]


def uses_per_token_loss(model_name: str, variable_seq_lengths: bool) -> bool:
    """megatron-core's calculate_per_token_loss for this run: GPT with --variable-seq-lengths."""
    return variable_seq_lengths and model_name == "gpt"
