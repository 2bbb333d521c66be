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


def gpt_forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_gpt_loss, batch["loss_mask"])


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


def make_forward_step(model_name: str) -> Callable:
    return {"gpt": gpt_forward_step, "bert": bert_forward_step}[model_name]
