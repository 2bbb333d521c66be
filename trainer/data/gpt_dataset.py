"""GPT pretraining samples addressed by sample number: ``dataset[i]`` depends only on (data, i, seed).

Like Megatron-Core's GPTDataset, documents (indexed sequences) are concatenated in a shuffled order
and cut into samples of ``seq_length + 1`` tokens that overlap by one token (inputs and shifted labels).
Each epoch uses its own document order and sample order, both drawn from ``(seed, epoch)``; asking for
more samples than one epoch holds simply continues into the next epoch. There is no state that
``next()`` would advance: the DPP runtime may fetch microbatches in any order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.indexed import open_indexed_dataset

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _EpochPlan:
    document_order: np.ndarray
    """Indexed-sequence ids in this epoch's order."""
    document_starts: np.ndarray
    """Offset of each ordered document in the epoch's token stream, plus the total at the end."""
    sample_order: np.ndarray
    """Position in the token stream (in samples) of the epoch's j-th sample."""


class GPTSampleDataset:
    """Fixed-length causal-LM samples from a ``..._text_document`` indexed dataset."""

    def __init__(self, prefix: str | Path, seq_length: int, seed: int, num_samples: int | None = None) -> None:
        problems = []
        if seq_length < 1:
            problems.append(f"seq_length={seq_length} must be >= 1")
        if num_samples is not None and num_samples < 1:
            problems.append(f"num_samples={num_samples} must be >= 1 (or None for one epoch)")
        if problems:
            raise ValueError("invalid GPT dataset: " + "; ".join(problems))
        self.prefix = str(prefix)
        self.seq_length = seq_length
        self.seed = seed
        self._indexed = open_indexed_dataset(self.prefix)
        self._lengths = np.asarray(self._indexed.sequence_lengths, dtype=np.int64)
        total_tokens = int(self._lengths.sum())
        # The last sample needs one token past its end (the final label), hence the - 1.
        self.samples_per_epoch = (total_tokens - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise ValueError(
                f"{self.prefix} holds {total_tokens} tokens, fewer than seq_length + 1 = {seq_length + 1}"
            )
        self.num_samples = num_samples if num_samples is not None else self.samples_per_epoch
        self._plans: dict[int, _EpochPlan] = {}
        logger.info("GPT data %s: %d documents, %d tokens, %d samples/epoch of %d tokens, %d samples",
                    self.prefix, len(self._lengths), total_tokens, self.samples_per_epoch, seq_length,
                    self.num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def _plan(self, epoch: int) -> _EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(len(self._lengths))
            starts = np.concatenate([[0], np.cumsum(self._lengths[order])])
            plan = _EpochPlan(order, starts, rng.permutation(self.samples_per_epoch))
            # Keep the two most recent epochs: consecutive microbatches straddle at most one boundary.
            if len(self._plans) >= 2:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = plan
        return plan

    def _tokens(self, plan: _EpochPlan, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the epoch's concatenated stream from position ``start``."""
        pieces = []
        doc = int(np.searchsorted(plan.document_starts, start, side="right")) - 1
        offset = start - int(plan.document_starts[doc])
        while count > 0:
            sequence = int(plan.document_order[doc])
            take = min(count, int(self._lengths[sequence]) - offset)
            if take > 0:
                pieces.append(self._indexed.get(sequence, offset=offset, length=take))
                count -= take
            doc, offset = doc + 1, 0
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} outside [0, {self.num_samples})")
        epoch, position = divmod(int(index), self.samples_per_epoch)
        plan = self._plan(epoch)
        start = int(plan.sample_order[position]) * self.seq_length
        tokens = self._tokens(plan, start, self.seq_length + 1)
        return {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": np.ones(self.seq_length, dtype=np.float32),
            "position_ids": np.arange(self.seq_length, dtype=np.int64),
        }
