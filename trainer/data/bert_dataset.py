"""BERT pretraining samples (masked LM + sentence order) addressed by sample number.

Training reads fixed-length BERT samples through megatron-core's BERTMaskedWordPieceDataset
(trainer/data/megatron_datasets.py); this dataset serves ``--variable-seq-lengths``, whose samples
must carry their real length (``"length"``), which megatron-core's do not.

Built on a ``..._text_sentence`` indexed dataset (``python -m trainer.preprocess --split-sentences``):
consecutive sentences of one document are grouped until they fill ``seq_length - 3`` tokens; each
group is one sample ``[CLS] A [SEP] B [SEP]``. As in Megatron-Core's BERTMaskedWordPieceDataset, A/B
are split at a random sentence and swapped with probability 0.5 (``is_random``), the longer segment
is trimmed at a random end until the pair fits, and ``masked_lm_prob`` of the word pieces are chosen
for prediction: 80% become [MASK], 10% a random token, 10% stay. Every random choice of sample ``i``
comes from ``numpy.random.default_rng([seed, i])``, so a sample never depends on which samples were
read before it.

The output keys are what megatron-core's ``BertModel.forward`` and Megatron's BERT loss consume:
``text`` -> input_ids, ``padding_mask`` -> attention_mask (1 = real token), ``types`` ->
tokentype_ids, ``labels`` -> lm_labels (-1 where nothing is predicted), ``loss_mask`` (1.0 at
predicted positions), ``is_random`` -> the binary-head target.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np

from trainer.data.indexed import open_indexed_dataset
from trainer.problems import raise_if_any

log = logging.getLogger(__name__)

NOT_PREDICTED = -1  # label of positions without a masked-LM target (Megatron's value)


class BertTokenizerLike(Protocol):
    vocab_size: int
    pad: int
    cls: int
    sep: int
    mask: int
    special_ids: frozenset[int]


def build_sentence_groups(bounds: np.ndarray, lengths: np.ndarray, max_tokens: int,
                          min_sentences: int) -> np.ndarray:
    """(first, end) sentence ranges: consecutive sentences of one document up to ``max_tokens``.

    A group closes once it reaches ``max_tokens`` and holds ``min_sentences``; a shorter tail of a
    document joins the document's previous group (it is trimmed later), or is dropped if there is none.
    """
    groups: list[list[int]] = []
    for doc in range(len(bounds) - 1):
        first, end = int(bounds[doc]), int(bounds[doc + 1])
        if end - first < min_sentences:
            continue
        start, tokens, doc_groups = first, 0, 0
        for sentence in range(first, end):
            tokens += int(lengths[sentence])
            if tokens >= max_tokens and sentence + 1 - start >= min_sentences:
                groups.append([start, sentence + 1])
                start, tokens, doc_groups = sentence + 1, 0, doc_groups + 1
        if start < end:
            if end - start >= min_sentences:
                groups.append([start, end])
            elif doc_groups:
                groups[-1][1] = end
    return np.asarray(groups, dtype=np.int64).reshape(-1, 2)


class BertSampleDataset:
    """Sentence-pair masked-LM samples of exactly ``seq_length`` tokens (padded)."""

    def __init__(self, prefix: str | Path, seq_length: int, tokenizer: BertTokenizerLike, seed: int,
                 masked_lm_prob: float = 0.15, binary_head: bool = True,
                 num_samples: int | None = None) -> None:
        specials = 3 if binary_head else 2  # [CLS] A [SEP] (B [SEP])
        problems = []
        if seq_length < specials + 2:
            problems.append(f"seq_length={seq_length} must be >= {specials + 2} to hold {specials} special tokens")
        if not 0.0 < masked_lm_prob < 1.0:
            problems.append(f"masked_lm_prob={masked_lm_prob} must be in (0, 1)")
        if num_samples is not None and num_samples < 1:
            problems.append(f"num_samples={num_samples} must be >= 1 (or None for one epoch)")
        raise_if_any(problems, "invalid BERT dataset")
        self.prefix, self.seq_length, self.seed = str(prefix), seq_length, seed
        self.tokenizer, self.masked_lm_prob, self.binary_head = tokenizer, masked_lm_prob, binary_head
        self.max_tokens = seq_length - specials
        self._indexed = open_indexed_dataset(self.prefix, getattr(tokenizer, "vocab_size", None))
        lengths = np.asarray(self._indexed.sequence_lengths, dtype=np.int64)
        self._groups = build_sentence_groups(np.asarray(self._indexed.document_indices), lengths,
                                             self.max_tokens, 2 if binary_head else 1)
        self.samples_per_epoch = len(self._groups)
        if self.samples_per_epoch == 0:
            raise ValueError(f"{self.prefix} has no document with 2 or more sentences; the binary head needs"
                             " sentence pairs (preprocess with --split-sentences)")
        self.num_samples = num_samples if num_samples is not None else self.samples_per_epoch
        self._epoch_order: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))
        self._random_tokens = np.setdiff1d(np.arange(tokenizer.vocab_size), sorted(tokenizer.special_ids))
        log.info("BERT data %s: %d sentences, %d samples/epoch of %d tokens, %d samples", self.prefix,
                    len(lengths), self.samples_per_epoch, seq_length, self.num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def sentence_range(self, index: int) -> tuple[int, int]:
        """(first, end) indexed-sentence ids that sample ``index`` is drawn from."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} outside [0, {self.num_samples})")
        first, end = self._group_of(int(index))
        return int(first), int(end)

    def _group_of(self, index: int) -> np.ndarray:
        epoch, position = divmod(index, self.samples_per_epoch)
        if self._epoch_order[0] != epoch:  # one permutation per epoch, reused by all its samples
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(self.samples_per_epoch)
            self._epoch_order = (epoch, order)
        return self._groups[self._epoch_order[1][position]]

    def _segments(self, rng: np.random.Generator, first: int, end: int) -> tuple[np.ndarray, np.ndarray, bool]:
        sentences = [np.asarray(self._indexed[i], dtype=np.int64) for i in range(first, end)]
        if not self.binary_head:
            return np.concatenate(sentences), np.empty(0, dtype=np.int64), False
        pivot = 1 if len(sentences) == 2 else int(rng.integers(1, len(sentences)))
        a, b = np.concatenate(sentences[:pivot]), np.concatenate(sentences[pivot:])
        is_random = bool(rng.random() < 0.5)
        return (b, a, True) if is_random else (a, b, False)

    def _trim(self, rng: np.random.Generator, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drop tokens from a random end of the longer segment until both fit in ``max_tokens``."""
        bounds = [[0, len(a)], [0, len(b)]]
        while (bounds[0][1] - bounds[0][0]) + (bounds[1][1] - bounds[1][0]) > self.max_tokens:
            longer = bounds[0] if bounds[0][1] - bounds[0][0] > bounds[1][1] - bounds[1][0] else bounds[1]
            if rng.random() < 0.5:
                longer[0] += 1
            else:
                longer[1] -= 1
        return a[bounds[0][0]:bounds[0][1]], b[bounds[1][0]:bounds[1][1]]

    def _mask(self, rng: np.random.Generator, tokens: np.ndarray, candidates: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(masked tokens, predicted positions, their original ids) with the 80/10/10 rule."""
        count = min(len(candidates), max(1, round(len(candidates) * self.masked_lm_prob)))
        positions = np.sort(rng.choice(candidates, size=count, replace=False))
        originals = tokens[positions].copy()
        masked = tokens.copy()
        for position in positions:
            draw = rng.random()
            if draw < 0.8:
                masked[position] = self.tokenizer.mask
            elif draw < 0.9:
                masked[position] = self._random_tokens[rng.integers(len(self._random_tokens))]
        return masked, positions, originals

    def __getitem__(self, index: int) -> dict[str, np.ndarray | int]:
        first, end = self.sentence_range(index)
        rng = np.random.default_rng([self.seed, int(index)])
        a, b, is_random = self._segments(rng, first, end)
        truncated = len(a) + len(b) > self.max_tokens
        a, b = self._trim(rng, a, b)
        tok = self.tokenizer
        parts = [[tok.cls], a, [tok.sep]] + ([b, [tok.sep]] if self.binary_head else [])
        tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        types = np.concatenate([np.zeros(len(a) + 2, dtype=np.int64), np.ones(len(tokens) - len(a) - 2, np.int64)])
        candidates = np.flatnonzero((tokens != tok.cls) & (tokens != tok.sep))
        masked, positions, originals = self._mask(rng, tokens, candidates)

        pad = self.seq_length - len(tokens)
        labels = np.full(self.seq_length, NOT_PREDICTED, dtype=np.int64)
        labels[positions] = originals
        loss_mask = np.zeros(self.seq_length, dtype=np.float32)
        loss_mask[positions] = 1.0
        return {
            "text": np.pad(masked, (0, pad), constant_values=tok.pad),
            "types": np.pad(types, (0, pad)),
            "labels": labels,
            "loss_mask": loss_mask,
            "padding_mask": np.pad(np.ones(len(tokens), dtype=np.int64), (0, pad)),
            "is_random": int(is_random),
            "truncated": int(truncated),
            "length": len(tokens),  # real positions, for --variable-seq-lengths bucketing (not batched)
        }
