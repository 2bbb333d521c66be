"""Opening megatron-core indexed datasets (.bin/.idx) with errors that name the missing or damaged file."""

from __future__ import annotations

import functools
import struct
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def open_indexed_dataset(prefix: str | Path, vocab_size: int | None = None):
    """megatron-core's ``IndexedDataset`` (memory-mapped) for ``prefix``.{bin,idx}; with
    ``vocab_size``, every token id is checked to be below it (:func:`check_token_ids`).

    Its items are numpy views of the memory map, which the dataset unmaps when it is garbage
    collected: copy them (``np.array(item)``) before dropping the dataset, or reading them segfaults.

    The import is local because megatron-core's package import is slow (seconds) and warns about
    missing Transformer Engine / Apex, which does not matter for reading token files.
    """
    prefix = str(prefix)
    for suffix in (".idx", ".bin"):
        if not Path(prefix + suffix).is_file():
            raise FileNotFoundError(
                f"indexed dataset file not found: {prefix}{suffix} (make it with python -m trainer.preprocess)"
            )
    try:
        dataset = _dataset_class()(prefix)
    except (ValueError, AssertionError, struct.error, IndexError, TypeError) as err:
        # A cut-off or foreign .idx: numpy's "buffer is smaller than requested size", megatron-core's
        # bare assertion on the header, ... none of which says which file.
        raise ValueError(f"indexed dataset index {prefix}.idx is damaged or not a megatron-core index "
                         f"({type(err).__name__}: {err or 'header check failed'}): re-run python -m "
                         "trainer.preprocess") from None
    check_bin_size(prefix, dataset.index)
    if vocab_size is not None:
        check_token_ids(prefix, dataset.index, vocab_size)
    return dataset


@functools.cache
def _dataset_class() -> type:
    """megatron-core's ``IndexedDataset`` whose ``__del__`` tolerates a failed ``__init__``: megatron-core's
    deletes ``index`` and ``bin_reader`` unconditionally, so a damaged .idx would print "Exception ignored
    in IndexedDataset.__del__ ... has no attribute 'index'" after the error that names the file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    class Dataset(IndexedDataset):
        def __del__(self) -> None:
            for name in ("bin_reader", "index"):  # what megatron-core's __del__ drops, where set
                self.__dict__.pop(name, None)

    Dataset.__name__ = Dataset.__qualname__ = "IndexedDataset"
    return Dataset


_SCAN_TOKENS = 1 << 24  # tokens per read while checking ids: 32-64 MiB at a time, whatever the file's size


def check_token_ids(prefix: str, index: Any, vocab_size: int) -> None:
    """ValueError naming the .bin, the first token id >= ``vocab_size``, its sequence and the
    vocabulary when the file holds one.

    Why before training: such an id indexes past the embedding table, which fails in the first
    iteration as an IndexError (CPU) or a device-side assert (CUDA) naming neither the file nor the
    id: a dataset tokenized with another, larger vocabulary than the run's --vocab-file. Reading
    the whole file once costs a sequential pass; a dtype that cannot hold such an id skips it.
    """
    dtype = np.dtype(index.dtype)
    if np.iinfo(dtype).max < vocab_size:
        return
    bin_path = Path(prefix + ".bin")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    for start in range(0, len(tokens), _SCAN_TOKENS):
        block = tokens[start:start + _SCAN_TOKENS]
        if block.max(initial=0) < vocab_size:
            continue
        at = start + int(np.argmax(block >= vocab_size))
        sequence = int(np.searchsorted(np.asarray(index.sequence_pointers) // dtype.itemsize, at, side="right")) - 1
        raise ValueError(f"indexed dataset {bin_path} holds token id {int(tokens[at])} (token {at}, sequence "
                         f"{sequence}) but the vocabulary has {vocab_size} ids: it was tokenized with another "
                         "vocabulary than this run's --vocab-file/--tokenizer-type (or --vocab-size); re-run "
                         "python -m trainer.preprocess with this run's tokenizer")


def check_bin_size(prefix: str, index: Any) -> None:
    """ValueError naming the .bin when its size is not what the .idx says it holds.

    megatron-core maps the .bin without looking at its size, so a short file (a copy cut off, a full
    disk) fails only when a sample past its end is read, iterations into training, with a numpy error
    naming no file; a longer one means the two files do not belong together.
    """
    bin_path = Path(prefix + ".bin")
    actual = bin_path.stat().st_size
    if len(index.sequence_lengths):
        last = len(index.sequence_lengths) - 1
        expected = int(index.sequence_pointers[last]) + int(index.sequence_lengths[last]) * int(index.dtype_size)
    else:
        expected = 0
    if actual != expected:
        raise ValueError(
            f"indexed dataset {bin_path} is {actual} bytes but {prefix}.idx describes {expected} bytes"
            f" ({len(index.sequence_lengths)} sequences): the file is truncated or does not belong to that"
            " index; re-run python -m trainer.preprocess"
        )


def collate_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts (numpy arrays or scalars) into one batch of tensors, key by key."""
    if not samples:
        raise ValueError("collate_samples needs at least one sample")
    return {key: torch.from_numpy(np.stack([np.asarray(s[key]) for s in samples])) for key in samples[0]}
