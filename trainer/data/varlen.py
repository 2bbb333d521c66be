"""Variable-length microbatches (``--variable-seq-lengths``): each microbatch is as long as its documents.

Samples are still produced padded to ``--seq-length`` with their real length under the key
``"length"``; :func:`bucket_samples` then cuts every sample of one microbatch to a shared length: the
longest real length among them, rounded up to a multiple of ``--seq-length-divisible-by`` and capped
at ``--seq-length``. A microbatch is always the same ``micro_batch_size`` consecutive sample indices
(trainer.model.batches.BatchPlan), whatever the layout, so its length is the same in every layout,
DP ranks included, and in the single-process reference.

``--mock-data`` gets documents too: :func:`mock_document_length` draws each mock sample's length from
a log-normal distribution seeded by (seed, sample index) -- the simulator's ``--seq-len-dist
lognormal:SIGMA`` (a length ratio with mean 1) times a nominal mean length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LENGTH_KEY = "length"
"""Sample key holding the number of real (unpadded) positions; never stacked into a batch."""
_MOCK_LENGTH_STREAM = 13  # third seed word: mock lengths must not reuse the token generator's draws


@dataclass(frozen=True)
class LengthDistribution:
    """A parsed ``--mock-seq-len-dist`` value: ``lognormal:SIGMA[:MEAN]``."""

    sigma: float
    """Log-normal sigma of the length ratio (mean 1), as the simulator's ``--seq-len-dist``."""
    mean: int | None = None
    """Nominal mean length in tokens before capping; None = half of ``--seq-length``."""

    def mean_for(self, seq_length: int) -> int:
        return self.mean if self.mean is not None else max(1, seq_length // 2)


def parse_length_distribution(text: str) -> tuple[LengthDistribution | None, list[str]]:
    """(distribution, problems) for a ``--mock-seq-len-dist`` value; every problem names the value."""
    parts = text.split(":")
    bad = [f"--mock-seq-len-dist={text!r} must be lognormal:SIGMA or lognormal:SIGMA:MEAN "
           "(SIGMA > 0, MEAN >= 1 tokens; e.g. lognormal:0.6)"]
    if parts[0] != "lognormal" or len(parts) not in (2, 3):
        return None, bad
    try:
        sigma = float(parts[1])
        mean = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        return None, bad
    if not math.isfinite(sigma) or sigma <= 0 or (mean is not None and mean < 1):
        return None, bad
    return LengthDistribution(sigma, mean), []


def mock_document_length(seed: int, index: int, seq_length: int, dist: LengthDistribution,
                         minimum: int = 1) -> int:
    """Real length of mock sample ``index``: mean-one log-normal ratio x mean, in [minimum, seq_length]."""
    rng = np.random.default_rng([seed, index, _MOCK_LENGTH_STREAM])
    ratio = math.exp(dist.sigma * float(rng.standard_normal()) - dist.sigma ** 2 / 2)
    return int(min(seq_length, max(minimum, round(ratio * dist.mean_for(seq_length)))))


@dataclass(frozen=True)
class Bucketing:
    """How a microbatch's shared length is chosen (``--seq-length-divisible-by``, ``--seq-length``)."""

    multiple: int
    """Lengths are rounded up to a multiple of this."""
    seq_length: int
    """Cap, and the length every sample arrives padded to."""

    def apply(self, samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return bucket_samples(samples, self.multiple, self.seq_length)


def bucket_length(lengths: Sequence[int], multiple: int, seq_length: int) -> int:
    """Shared length of one microbatch: the longest sample, rounded up to ``multiple``, at most ``seq_length``."""
    longest = max(int(n) for n in lengths)
    assert 1 <= longest <= seq_length, f"sample length {longest} outside [1, {seq_length}]"
    return min(seq_length, -(-longest // multiple) * multiple)


def bucket_lengths(multiple: int, seq_length: int) -> tuple[int, ...]:
    """Every length :func:`bucket_length` can return, ascending: the multiples of ``multiple`` below
    ``seq_length``, and ``seq_length``."""
    return tuple(sorted({min(seq_length, k * multiple) for k in range(1, -(-seq_length // multiple) + 1)}))


def bucket_samples(samples: Sequence[Mapping[str, Any]], multiple: int, seq_length: int
                   ) -> list[dict[str, Any]]:
    """Cut every per-position array of each sample to the microbatch's shared length (bucketing)."""
    length = bucket_length([s[LENGTH_KEY] for s in samples], multiple, seq_length)
    out = []
    for sample in samples:
        cut = {}
        for key, value in sample.items():
            is_positions = isinstance(value, np.ndarray) and value.ndim == 1 and len(value) == seq_length
            cut[key] = value[:length] if is_positions else value
        out.append(cut)
    return out
