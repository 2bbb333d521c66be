"""Microbatches fetched by index: which samples microbatch m of an iteration holds, and their tensors.

Sample order follows Megatron's pretraining sampler: an iteration consumes ``global_batch_size``
consecutive sample indices; inside it, microbatch ``m`` of data-parallel rank ``d`` holds samples
``start + m * mbs * dp + d * mbs + j`` (j < mbs). A DP=1 reference run therefore sees exactly the
union of what the DP replicas see, and execution order never changes which tokens a microbatch has.

Samples are dicts of NumPy arrays in trainer.data's format (GPTSampleDataset / BertSampleDataset).
``--mock-data`` samples come from a generator seeded by (seed, sample index): noisy arithmetic
progressions modulo the vocabulary, so a tiny model has something learnable and its loss can drop.
With ``--variable-seq-lengths`` a mock sample is a "document" whose length is drawn by
trainer.data.varlen.mock_document_length, padded to ``--seq-length`` (loss mask 0 on the padding), and
:func:`host_batch` cuts each microbatch to its longest sample (trainer.data.varlen.Bucketing).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.data.varlen import LENGTH_KEY, Bucketing, LengthDistribution, mock_document_length

Sample = Mapping[str, Any]
SampleSource = Callable[[int], Sample]
"""sample index -> one sample dict."""

BERT_PAD, BERT_CLS, BERT_SEP, BERT_MASK, BERT_RESERVED = 0, 1, 2, 3, 4
NOT_PREDICTED = -1


def mock_tokens(seed: int, index: int, length: int, vocab_size: int, reserved: int = 0) -> np.ndarray:
    """Deterministic synthetic tokens for one sample (ids in [reserved, vocab_size))."""
    rng = np.random.default_rng([seed, index])
    span = vocab_size - reserved
    start, step = rng.integers(0, span), rng.integers(1, 5)
    tokens = (start + step * np.arange(length)) % span
    noise = rng.random(length) < 0.1  # 10% random tokens: learnable, but not trivially
    tokens[noise] = rng.integers(0, span, int(noise.sum()))
    return (tokens + reserved).astype(np.int64)


def mock_gpt_sample(seed: int, index: int, seq_length: int, vocab_size: int,
                    length: int | None = None) -> dict[str, Any]:
    """``length=None``: ``seq_length`` real tokens (the fixed path). Otherwise ``length`` real tokens
    padded to ``seq_length`` (loss mask 0 there), with the real length under ``"length"``."""
    if length is None:
        tokens = mock_tokens(seed, index, seq_length + 1, vocab_size)
        return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": np.ones(seq_length, np.float32),
                "position_ids": np.arange(seq_length, dtype=np.int64)}
    tokens = mock_tokens(seed, index, length + 1, vocab_size)
    pad = seq_length - length
    return {"tokens": np.pad(tokens[:-1], (0, pad)), "labels": np.pad(tokens[1:], (0, pad)),
            "loss_mask": np.pad(np.ones(length, np.float32), (0, pad)),
            "position_ids": np.arange(seq_length, dtype=np.int64), LENGTH_KEY: length}


MOCK_BERT_MIN_LENGTH = 5
"""[CLS] a [SEP] b [SEP]: the shortest mock BERT sample with one token per segment."""


def mock_bert_sample(seed: int, index: int, seq_length: int, vocab_size: int,
                     mask_prob: float = 0.15, length: int | None = None) -> dict[str, Any]:
    """[CLS] A [SEP] B [SEP] with 15% of body tokens masked; halves swapped (is_random=1) half the time.
    ``length`` (>= 5): the real length before padding to ``seq_length``; None fills ``seq_length``."""
    rng = np.random.default_rng([seed, index, 7])
    half = ((seq_length if length is None else length) - 3) // 2
    body = mock_tokens(seed, index, 2 * half, vocab_size, reserved=BERT_RESERVED)
    a, b = body[:half], body[half:]
    is_random = int(rng.random() < 0.5)
    if is_random:
        a, b = b, a
    tokens = np.concatenate([[BERT_CLS], a, [BERT_SEP], b, [BERT_SEP]]).astype(np.int64)
    pad = seq_length - len(tokens)
    positions = np.flatnonzero(tokens >= BERT_RESERVED)
    chosen = positions[rng.random(len(positions)) < mask_prob]
    if len(chosen) == 0:  # at least one prediction per sample keeps the loss defined
        chosen = positions[:1]
    labels = np.full(seq_length, NOT_PREDICTED, dtype=np.int64)
    labels[chosen] = tokens[chosen]
    text = tokens.copy()
    text[chosen] = BERT_MASK
    loss_mask = np.zeros(seq_length, np.float32)
    loss_mask[chosen] = 1.0
    types = np.concatenate([np.zeros(half + 2, np.int64), np.ones(len(tokens) - half - 2, np.int64)])
    return {"text": np.pad(text, (0, pad), constant_values=BERT_PAD), "types": np.pad(types, (0, pad)),
            "labels": labels, "loss_mask": loss_mask,
            "padding_mask": np.pad(np.ones(len(tokens), np.int64), (0, pad)), "is_random": is_random,
            **({} if length is None else {LENGTH_KEY: len(tokens)})}


def mock_sample_source(model: str, seed: int, seq_length: int, vocab_size: int,
                       lengths: LengthDistribution | None = None) -> SampleSource:
    """``--mock-data`` samples by index; with ``lengths`` (``--mock-seq-len-dist``), documents of drawn length."""
    if lengths is None:
        make = mock_gpt_sample if model == "gpt" else mock_bert_sample
        return lambda i: make(seed, i, seq_length, vocab_size)
    if model == "gpt":
        return lambda i: mock_gpt_sample(seed, i, seq_length, vocab_size,
                                         length=mock_document_length(seed, i, seq_length, lengths))
    return lambda i: mock_bert_sample(seed, i, seq_length, vocab_size, length=mock_document_length(
        seed, i, seq_length, lengths, minimum=MOCK_BERT_MIN_LENGTH))


@dataclass(frozen=True)
class BatchPlan:
    """Maps (iteration's first sample, microbatch) to the sample indices of this DP rank."""

    micro_batch_size: int
    data_parallel: int
    dp_rank: int

    def indices(self, start: int, microbatch: int) -> list[int]:
        base = start + microbatch * self.micro_batch_size * self.data_parallel + self.dp_rank * self.micro_batch_size
        return [base + j for j in range(self.micro_batch_size)]


def host_batch(samples: list[Sample], model: str, bucketing: Bucketing | None = None) -> dict[str, torch.Tensor]:
    """Stack samples into one microbatch of CPU tensors (no attention mask: see :func:`causal_mask`).
    With ``bucketing`` (``--variable-seq-lengths``) the microbatch is first cut to its longest sample."""
    if bucketing is not None:
        samples = bucketing.apply(samples)
    return {key: torch.as_tensor(np.stack([np.asarray(s[key]) for s in samples]))
            for key in samples[0] if key not in ("truncated", LENGTH_KEY)}


@functools.lru_cache(maxsize=128)
def causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """GPT's causal mask (True = masked), made once per length and device: megatron only reads it,
    so every microbatch can share one tensor instead of building and copying its own. 128 entries:
    with --variable-seq-lengths there is one per bucket (16 at seq 1024 rounded to 64), about 6 MB."""
    return torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)


def collate(samples: list[Sample], model: str, device: torch.device,
            bucketing: Bucketing | None = None) -> dict[str, torch.Tensor]:
    """Stack samples into one microbatch on ``device``; GPT also gets the causal mask (True = masked)."""
    batch = {key: t.to(device) for key, t in host_batch(samples, model, bucketing).items()}
    if model == "gpt":
        batch["attention_mask"] = causal_mask(batch["tokens"].shape[1], torch.device(device))
    return batch
