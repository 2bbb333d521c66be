"""GPT pretraining samples addressed by sample number: ``dataset[i]`` depends only on (data, i, seed).

Training reads fixed-length GPT samples through megatron-core's dataset builder
(trainer/data/megatron_datasets.py); of this module it uses GPTDocumentDataset (``--variable-seq-lengths``,
which megatron-core's GPTDataset cannot express). GPTSampleDataset remains, with its tests, as the
project's own reading of the same windows.

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
from trainer.problems import raise_if_any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _EpochPlan:
    document_order: np.ndarray
    """Indexed-sequence ids in this epoch's order."""
    document_starts: np.ndarray
    """Offset of each ordered document in the epoch's token stream, plus the total at the end."""
    sample_order: np.ndarray
    """Position in the token stream (in samples) of the epoch's j-th sample."""


def _check_sizes(what: str, seq_length: int, num_samples: int | None) -> None:
    """ValueError naming every bad size (both GPT datasets take the same two)."""
    problems = []
    if seq_length < 1:
        problems.append(f"seq_length={seq_length} must be >= 1")
    if num_samples is not None and num_samples < 1:
        problems.append(f"num_samples={num_samples} must be >= 1 (or None for one epoch)")
    raise_if_any(problems, f"invalid {what}")


class GPTSampleDataset:
    """Fixed-length causal-LM samples from a ``..._text_document`` indexed dataset."""

    def __init__(self, prefix: str | Path, seq_length: int, seed: int, num_samples: int | None = None) -> None:
        _check_sizes("GPT dataset", seq_length, num_samples)
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
        log.info("GPT data %s: %d documents, %d tokens, %d samples/epoch of %d tokens, %d samples",
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


class GPTDocumentDataset:
    """``--variable-seq-lengths`` samples: one document (or one piece of a long one) per sample.

    A document of ``D`` tokens gives ``D - 1`` input/label positions; a long one is split into pieces
    of at most ``seq_length`` positions (consecutive pieces share one token, as the fixed windows do).
    Pieces of one-token documents have nothing to predict and are dropped. Each epoch visits every
    piece once in an order drawn from ``(seed, epoch)``. A sample is padded to ``seq_length`` (tokens
    and labels with ``pad_id``, ``loss_mask`` 0) and says its real length under ``"length"``; its
    position ids start at 0, since it starts a document or continues one cut at a piece boundary.
    trainer.data.varlen.bucket_samples then cuts a microbatch to its longest sample.
    """

    def __init__(self, prefix: str | Path, seq_length: int, seed: int, num_samples: int | None = None,
                 pad_id: int = 0) -> None:
        _check_sizes("GPT document dataset", seq_length, num_samples)
        self.prefix, self.seq_length, self.seed, self.pad_id = str(prefix), seq_length, seed, pad_id
        self._indexed = open_indexed_dataset(self.prefix)
        lengths = np.asarray(self._indexed.sequence_lengths, dtype=np.int64)
        positions = np.maximum(lengths - 1, 0)
        pieces_per_doc = -(-positions // seq_length)
        self._doc = np.repeat(np.arange(len(lengths)), pieces_per_doc)
        first_piece = np.concatenate([[0], np.cumsum(pieces_per_doc)[:-1]])
        self._offset = (np.arange(len(self._doc)) - np.repeat(first_piece, pieces_per_doc)) * seq_length
        self._positions = np.minimum(seq_length, positions[self._doc] - self._offset)
        self.samples_per_epoch = len(self._doc)
        if self.samples_per_epoch < 1:
            raise ValueError(f"{self.prefix} has no document of 2 or more tokens")
        self.num_samples = num_samples if num_samples is not None else self.samples_per_epoch
        self._epoch_order: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))
        log.info("GPT documents %s: %d documents, %d pieces/epoch of at most %d positions (mean %.0f), "
                    "%d samples", self.prefix, len(lengths), self.samples_per_epoch, seq_length,
                    float(self._positions.mean()), self.num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def piece_lengths(self) -> np.ndarray:
        """Real length (positions) of every piece, in piece order: the corpus's length distribution."""
        return self._positions.copy()

    def _piece_of(self, index: int) -> int:
        epoch, position = divmod(index, self.samples_per_epoch)
        if self._epoch_order[0] != epoch:  # one permutation per epoch, reused by all its samples
            self._epoch_order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.samples_per_epoch))
        return int(self._epoch_order[1][position])

    def __getitem__(self, index: int) -> dict[str, np.ndarray | int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} outside [0, {self.num_samples})")
        piece = self._piece_of(int(index))
        n = int(self._positions[piece])
        tokens = np.asarray(self._indexed.get(int(self._doc[piece]), offset=int(self._offset[piece]), length=n + 1),
                            dtype=np.int64)
        pad = self.seq_length - n
        loss_mask = np.zeros(self.seq_length, dtype=np.float32)
        loss_mask[:n] = 1.0
        return {
            "tokens": np.pad(tokens[:-1], (0, pad), constant_values=self.pad_id),
            "labels": np.pad(tokens[1:], (0, pad), constant_values=self.pad_id),
            "loss_mask": loss_mask,
            "position_ids": np.arange(self.seq_length, dtype=np.int64),
            "length": n,
        }
