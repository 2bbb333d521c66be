"""``--split`` (Megatron-LM's train/valid/test shares) as a deterministic map from split-local to
global sample indices.

Megatron-LM's ``--split 969,30,1`` divides a dataset's *documents* into three ranges. This trainer's
samples come from an index -> sample function (mock data has no end), so the shares are taken of
*sample indices* instead, in repeating blocks: with integer weights (w_train, w_valid, w_test) and
W = their sum, global index ``b * W + r`` belongs to train when ``r < w_train``, to valid when
``w_train <= r < w_train + w_valid``, else to test. Sample k of a split is the k-th index of that
split in increasing order, so every rank computes the same assignment from the index alone, the
shares are exact over every block of W samples, and the three splits never share an index.

Weights are read like Megatron-LM reads them (comma- or slash-separated numbers, missing ones are 0,
normalised by their sum); decimals are scaled to the smallest equivalent integers
("0.969,0.03,0.001" is 969,30,1).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from trainer.problems import raise_if_any

MEGATRON_DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's default --split, used when validation is asked for without one."""

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(text: str) -> tuple[tuple[int, int, int] | None, list[str]]:
    """(integer weights, problems) of a --split string."""
    parts = [p for p in re.split(r"[,/]", text.strip()) if p.strip()]
    if not 1 <= len(parts) <= 3:
        return None, [f"--split={text!r} needs 1 to 3 comma-separated weights (train,valid,test)"]
    try:
        weights = [Fraction(p.strip()) for p in parts]
    except (ValueError, ZeroDivisionError):
        return None, [f"--split={text!r}: weights must be numbers, e.g. 969,30,1"]
    weights += [Fraction(0)] * (3 - len(weights))
    if any(w < 0 for w in weights) or sum(weights) == 0:
        return None, [f"--split={text!r}: weights must be >= 0 with a positive sum"]
    scale = math.lcm(*(w.denominator for w in weights))
    ints = [int(w * scale) for w in weights]
    common = math.gcd(*ints)
    return tuple(i // common for i in ints), []  # type: ignore[return-value]


@dataclass(frozen=True)
class SampleSplit:
    """Global sample index of the k-th sample of each split (see the module docstring)."""

    weights: tuple[int, int, int] = (1, 0, 0)

    @classmethod
    def parse(cls, text: str | None) -> SampleSplit:
        """None: every sample trains (no --split, no validation)."""
        if text is None:
            return cls()
        weights, problems = parse_split(text)
        raise_if_any(problems)
        return cls(weights)  # type: ignore[arg-type]

    def index(self, split: str, k: int) -> int:
        part = SPLIT_NAMES.index(split)
        width = self.weights[part]
        if width == 0:
            raise ValueError(f"--split {','.join(map(str, self.weights))} gives the {split} split no samples")
        block, offset = divmod(k, width)
        return block * sum(self.weights) + sum(self.weights[:part]) + offset

    def span(self, split: str, count: int) -> int:
        """Global indices [0, span) hold the first ``count`` samples of ``split``."""
        return self.index(split, count - 1) + 1 if count > 0 else 0
