"""Training data through megatron-core's dataset builder, as Megatron-LM's pretrain_gpt.py / pretrain_bert.py.

``BlendedMegatronDatasetBuilder(GPTDataset | BERTMaskedWordPieceDataset, sizes, ...)`` gives what
Megatron-LM users expect of ``--data-path``/``--split``/``--data-cache-path``:

- ``--data-path A`` or a blend ``--data-path 0.3 A 0.7 B`` (weights normalised; an odd-length or
  unweighted list of prefixes blends by dataset size), each prefix split into train/valid/test
  *documents* by ``--split``; megatron-core's BlendedDataset interleaves the datasets so that after n
  samples each has contributed its weight x n, to within one sample (its blending-index helper);
- the document/sample/shuffle indices (and a blend's dataset index) are built once by global rank 0
  and cached as ``.npy`` files -- under ``--data-cache-path``, else, as in Megatron-LM, in a
  ``cache/`` folder beside the data -- then read by every other rank after a barrier;
- GPT samples: ``seq_length + 1`` token windows of the shuffled document stream, tokens and shifted
  labels, loss mask 1, position ids 0..seq-1 (no --reset-position-ids / --eod-mask-loss here);
- BERT samples: megatron-core's masked sentence pairs with the masking Megatron-LM's pretrain_bert.py
  asks for (the keys of trainer/data/bert_dataset.py, which mimicked it).

Every sample is still a pure function of its split and index (the indices are seeded by --seed), so
the DPP runtime may read microbatches in any order. The index helpers are megatron-core's compiled
``helpers_cpp`` extension, shipped inside its wheel (0.16 for Python 3.11, 0.19 in the GPU images);
:func:`check_helpers` fails with the fix when it is missing instead of letting megatron-core try to
compile it with ``make`` on a compute node.

What stays the project's own (trainer/data/gpt_dataset.py, bert_dataset.py): ``--variable-seq-lengths``,
which needs each sample's real length (GPT: one document or piece of one per sample, which GPTDataset's
fixed windows cannot express; BERT: megatron-core's samples carry no length), split by sample index
(trainer/data/split.py) from one prefix.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.data.split import SPLIT_NAMES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Blend:
    """A parsed ``--data-path``: dataset prefixes and their weights (None: blend by dataset size)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None = None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_blend(data_path: Sequence[str]) -> tuple[Blend | None, list[str]]:
    """(blend, problems) of Megatron-LM's ``--data-path`` list: ``PREFIX [PREFIX ...]`` or
    ``WEIGHT PREFIX [WEIGHT PREFIX ...]`` (an even-length list whose every other item is a number)."""
    items = [item.strip() for item in data_path]
    if not items:
        return None, []
    given = f"--data-path {' '.join(items)}"
    pairs = len(items) % 2 == 0 and all(_number(w) is not None for w in items[::2])
    if not pairs:
        numbers = [item for item in items if _number(item) is not None]
        if numbers:  # a weight without a partner, or a prefix that happens to be a number
            return None, [f"{given}: weights and prefixes must alternate (WEIGHT PREFIX WEIGHT PREFIX ...); "
                          f"{' '.join(numbers)} looks like a weight without its dataset"]
        return Blend(tuple(items)), []
    weights = tuple(float(w) for w in items[::2])
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        return None, [f"{given}: blend weights must be >= 0 with a positive sum"]
    return Blend(tuple(items[1::2]), weights), []


def check_helpers() -> None:
    """RuntimeError naming the fix when megatron-core's compiled index helpers are missing.

    Megatron-LM compiles them at start-up with ``make`` in the installed package (rank 0 only, then a
    barrier); megatron-core's wheels ship them prebuilt. Here a missing extension is a broken
    installation, reported before any index is built rather than compiled behind the user's back.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "megatron-core's dataset index helpers (megatron.core.datasets.helpers_cpp) are not built: "
            f"{exc}. Reinstall megatron-core from a wheel (pip install --force-reinstall megatron-core), or "
            "build them in place: make -C $(python -c 'import megatron.core.datasets as d, os; "
            "print(os.path.dirname(d.__file__))')"
        ) from None


def _check_documents(dataset_cls: type, blend: Blend, split: str, split_matrix: list, requested: list[int],
                     vocab_size: int | None = None) -> None:
    """ValueError naming the prefix and split when a split that must give samples gets no document of a
    prefix (megatron-core's datasets would loop forever looking for its tokens). Documents are counted
    and ranged as megatron-core does: its dataset class's count, round(bookend x documents) at either end."""
    from trainer.data.indexed import open_indexed_dataset

    for prefix in blend.prefixes:
        # also checks the .bin: its size, and its ids against the tokenizer's vocabulary
        indexed = open_indexed_dataset(prefix, vocab_size)
        documents = int(dataset_cls.numel_low_level_dataset(indexed))
        for name, bookends, size in zip(SPLIT_NAMES, split_matrix, requested, strict=True):
            if size == 0:
                continue
            first, end = (0, 0) if bookends is None else (round(bookends[0] * documents), round(bookends[1] * documents))
            if end <= first:
                raise ValueError(f"--split {split} gives the {name} split none of the {documents} documents of "
                                 f"{prefix}, but {size} {name} samples are needed: change --split or add data")


def _check_cache(cache_dir: str | None, dataset_cls: type, blend: Blend) -> None:
    """RuntimeError naming the folder when global rank 0, which writes the index cache, cannot create it
    (megatron-core would fail deep in its index building, the other ranks waiting at its barrier)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    # megatron-core's default without --data-cache-path: a cache/ folder under each dataset prefix.
    folders = [cache_dir] if cache_dir else [os.path.join(p, "cache", f"{dataset_cls.__name__}_indices")
                                             for p in blend.prefixes]
    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise RuntimeError(f"megatron-core caches its dataset indices in {folder}, which rank 0 cannot create "
                               f"({exc.strerror or exc}): give --data-cache-path a writable folder") from None
        if not os.access(folder, os.W_OK):
            raise RuntimeError(f"megatron-core caches its dataset indices in {folder}, which rank 0 cannot write: "
                               "give --data-cache-path a writable folder")


class _GPTTokenizerView:
    """What GPTDataset reads of its tokenizer. No ``pad``: GPT pretraining samples are never padded,
    and Megatron-LM's GPT-2 tokenizer has none either (an EOD-valued pad would take every EOD out of
    the loss)."""

    def __init__(self, kind: str, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = {"class": kind, "vocab_size": vocab_size, "eod": eod}  # part of the cache key


class _BertTokenizerView:
    """What BERTMaskedWordPieceDataset reads of its tokenizer: the special ids, and the vocabulary by id
    (``inv_vocab``: whole-word masking keeps a word's ``##`` pieces together)."""

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size, self.inv_vocab = tokenizer.vocab_size, tokenizer.inv_vocab
        self.cls, self.sep, self.mask, self.pad, self.eod = (tokenizer.cls, tokenizer.sep, tokenizer.mask,
                                                             tokenizer.pad, tokenizer.eod)
        self.unique_identifiers = {"class": tokenizer.name, "vocab_size": self.vocab_size}


@dataclass(frozen=True)
class SplitSizes:
    """Samples each split must provide (Megatron-LM's ``train_val_test_num_samples``)."""

    train: int
    valid: int = 0
    test: int = 0


GPT_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""What the trainer's GPT step reads (megatron-core's attention mask is not built: the trainer makes it)."""


class MegatronSamples:
    """Train/valid/test samples built by megatron-core's BlendedMegatronDatasetBuilder;
    ``sample(split, k)`` -> numpy sample dict. Build with :func:`gpt_samples` or :func:`bert_samples`.

    COLLECTIVE when torch.distributed is initialised: every rank must construct it (rank 0 builds and
    caches the indices first, the others wait on a barrier of the default group and read them).
    """

    def __init__(self, what: str, dataset_cls: type, config: Any, blend: Blend, sizes: SplitSizes,
                 keys: tuple[str, ...] | None = None) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        requested = [sizes.train, sizes.valid, sizes.test]
        # Splits no sample is asked of are not built (megatron-core would build a split asked for 0
        # samples anyway, and loop forever on one without documents); the others keep --split's bookends.
        config.split_matrix = [bookends if size > 0 else None
                               for bookends, size in zip(config.split_matrix, requested, strict=True)]
        _check_documents(dataset_cls, blend, config.split, config.split_matrix, requested,
                         getattr(config.tokenizer, "vocab_size", None))
        _check_cache(config.path_to_cache, dataset_cls, blend)
        self.datasets = BlendedMegatronDatasetBuilder(dataset_cls, requested, lambda: True, config).build()
        self.split, self.keys = config.split, keys
        log.info("%s data (megatron-core builder) %s weights %s, --split %s: %s samples", what, " ".join(blend.prefixes),
                 "by size" if blend.weights is None else blend.weights, config.split,
                 ", ".join(f"{n} {0 if d is None else len(d)}" for n, d in zip(SPLIT_NAMES, self.datasets, strict=True)))

    def sample(self, split: str, k: int) -> dict[str, Any]:
        dataset = self.datasets[SPLIT_NAMES.index(split)]
        if dataset is None or not 0 <= k < len(dataset):
            size = 0 if dataset is None else len(dataset)
            raise IndexError(f"{split} sample {k} outside the {size} that megatron-core's builder made")
        item = dataset[k]
        out = {key: np.asarray(value.numpy() if hasattr(value, "numpy") else value)
               for key, value in item.items() if self.keys is None or key in self.keys}
        out.pop("dataset_id", None)  # a BlendedDataset's bookkeeping (dataset_of gives it)
        out["loss_mask"] = out["loss_mask"].astype(np.float32)  # megatron-core's BERT gives int64
        return out

    def dataset_of(self, split: str, k: int) -> int:
        """Which --data-path prefix sample ``k`` of ``split`` comes from (its position in the blend)."""
        dataset = self.datasets[SPLIT_NAMES.index(split)]
        if hasattr(dataset, "dataset_index"):  # a BlendedDataset
            return int(dataset.dataset_index[k])
        return 0


def _blend(blend: Blend) -> tuple[list[str], list[float] | None]:
    return list(blend.prefixes), None if blend.weights is None else list(blend.weights)


def gpt_samples(blend: Blend, split: str, seq_length: int, seed: int, sizes: SplitSizes, tokenizer_kind: str,
                vocab_size: int, eod: int, cache_dir: str | None = None) -> MegatronSamples:
    """GPT samples: GPTDataset windows of ``seq_length + 1`` tokens, as Megatron-LM's pretrain_gpt.py."""
    check_helpers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=_blend(blend), split=split, path_to_cache=cache_dir,
        tokenizer=_GPTTokenizerView(tokenizer_kind, vocab_size, eod),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,  # the trainer builds the causal mask on the device
    )
    return MegatronSamples("GPT", GPTDataset, config, blend, sizes, GPT_KEYS)


def bert_samples(blend: Blend, split: str, seq_length: int, seed: int, sizes: SplitSizes, tokenizer: Any,
                 binary_head: bool = True, cache_dir: str | None = None) -> MegatronSamples:
    """BERT samples: BERTMaskedWordPieceDataset sentence pairs with Megatron-LM's pretrain_bert.py masking
    (15% of word pieces, whole words, n-grams up to 3, 10% short sequences; [CLS] A [SEP] B [SEP])."""
    check_helpers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.bert_dataset import (
            BERTMaskedWordPieceDataset,
            BERTMaskedWordPieceDatasetConfig,
        )
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=_blend(blend), split=split, path_to_cache=cache_dir,
        tokenizer=_BertTokenizerView(tokenizer), masking_probability=0.15, short_sequence_probability=0.1,
        masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False, classification_head=binary_head,
    )
    return MegatronSamples("BERT", BERTMaskedWordPieceDataset, config, blend, sizes)
