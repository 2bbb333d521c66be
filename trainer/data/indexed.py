"""Opening megatron-core indexed datasets (.bin/.idx) with errors that name the missing or damaged file."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def open_indexed_dataset(prefix: str | Path):
    """megatron-core's ``IndexedDataset`` (memory-mapped) for ``prefix``.{bin,idx}.

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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    dataset = IndexedDataset(prefix)
    check_bin_size(prefix, dataset.index)
    return dataset


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
