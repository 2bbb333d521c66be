"""Stage boundaries inside a transformer layer: ``--pipeline-stage-layers 4.5,4,4,3.5`` (pure, no torch).

With whole layers per stage the slowest stage of a small model is often far above the mean (16 layers
on 4 stages: one stage of 5 layers, or the embedding / output head beside 4). A boundary between a
layer's attention and its MLP halves the unit a split moves: ``4.5`` on a stage means its last layer
ends after the attention (and its residual add); the next stage starts with that layer's pre-MLP
norm and MLP. Each half is a megatron-core ``TransformerLayer`` of the model's own spec with the
other half's modules as ``IdentityOp`` (scripts/layer_halves_probe.py shows the two compose to the
whole layer exactly), and both halves keep the layer's global ``layer_number``, so checkpoint keys,
the equivalence harness's weight mapping and initialisation stay those of the whole layer.

A stage's parts are in layer order: at most one MLP half (the layer its predecessor split), whole
layers, at most one attention half. Their layer numbers are consecutive from the first part's
layer, which is what megatron-core's block assumes (``layer_number = offset + i + 1``):
:func:`stage_offsets` is that offset for every stage.

Half units: unit ``2k`` is layer ``k``'s attention, ``2k + 1`` its MLP; a stage of ``x`` layers
holds ``2x`` units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

STAGE_LAYERS_FLAG = "--pipeline-stage-layers"

Part = Literal["layer", "attention", "mlp"]


@dataclass(frozen=True)
class LayerPart:
    """One module of a stage's transformer block: a whole layer or one half of it."""

    layer: int
    """Global 0-based layer index (megatron-core's ``layer_number - 1``)."""
    part: Part


def layer_count(value: float) -> float:
    """A stage's layer count as a split states it: 4.0 -> 4, 4.5 -> 4.5. Counts travel through JSON
    (traces, metrics) and arithmetic that can turn 4 into 4.0; whole counts stay ints so that every
    log, report and command line prints 4, and half counts are never truncated."""
    value = float(value)
    return int(value) if value.is_integer() else value


def parse_stage_layers(text: str) -> tuple[float, ...]:
    """``"4.5,4,4,3.5"`` (or ``4.5/4/4/3.5``) -> (4.5, 4, 4, 3.5); ValueError naming the bad entry."""
    out: list[float] = []
    for entry in text.replace("/", ",").split(","):
        entry = entry.strip()
        try:
            value = float(entry)
        except ValueError:
            raise ValueError(f"{STAGE_LAYERS_FLAG} {text!r}: {entry!r} is not a number") from None
        out.append(layer_count(value))
    return tuple(out)


def stage_layers_problems(num_layers: int, pp: int, vp: int, counts: Sequence[float]) -> list[str]:
    """Every way ``counts`` (layers per virtual stage, in halves) cannot lay out ``num_layers`` on ``pp``
    stages of ``vp`` chunks; empty: it can. With ``vp`` > 1 there is one count per virtual stage, in
    megatron-core's order: chunk 0 of every stage, then chunk 1..."""
    flag = f"{STAGE_LAYERS_FLAG} {'/'.join(map(_fmt, counts))}"
    p: list[str] = []
    if len(counts) != pp * vp:
        wanted = (f"--pipeline-model-parallel-size is {pp}" if vp == 1 else
                  f"{pp * vp} are needed: --pipeline-model-parallel-size {pp} x {vp} virtual stages per rank, "
                  "chunk 0 of every stage first")
        p.append(f"{flag} gives {len(counts)} stages, {wanted}")
    bad = [c for c in counts if not (math.isfinite(c) and c > 0 and float(2 * c).is_integer())]
    if bad:
        p.append(f"{flag}: every stage needs a positive whole or half number of layers (not {', '.join(map(_fmt, bad))})")
    elif sum(counts) != num_layers:
        p.append(f"{flag} places {_fmt(sum(counts))} layers, --num-layers is {num_layers}")
    return p


def _fmt(x: float) -> str:
    return str(layer_count(x))


def describe(counts: Sequence[float], sep: str = "/") -> str:
    """``"4.5/4/4/3.5"`` (whole counts as ``4``, not ``4.0``)."""
    return sep.join(map(_fmt, counts))


def half_bounds(counts: Sequence[float]) -> list[int]:
    """Each stage's first half unit, and the end: ``[0, 9, 17, 25, 32]`` for 4.5/4/4/3.5."""
    out = [0]
    for c in counts:
        out.append(out[-1] + round(2 * c))
    return out


def parts_of_units(start: int, end: int) -> list[LayerPart]:
    """The modules holding half units ``[start, end)``."""
    parts: list[LayerPart] = []
    unit = start
    if unit % 2 and unit < end:
        parts.append(LayerPart(unit // 2, "mlp"))
        unit += 1
    while unit + 2 <= end:
        parts.append(LayerPart(unit // 2, "layer"))
        unit += 2
    if unit < end:
        parts.append(LayerPart(unit // 2, "attention"))
    return parts


def stage_parts(counts: Sequence[float]) -> list[list[LayerPart]]:
    """``[stage] -> its modules in order``."""
    bounds = half_bounds(counts)
    return [parts_of_units(bounds[s], bounds[s + 1]) for s in range(len(counts))]


def stage_offsets(counts: Sequence[float]) -> list[int]:
    """Global index of each stage's first layer (the one its first part belongs to)."""
    return [b // 2 for b in half_bounds(counts)[:-1]]


def splits_inside_layers(counts: Sequence[float]) -> bool:
    """Whether any stage boundary falls between a layer's attention and its MLP."""
    return any(b % 2 for b in half_bounds(counts))


def whole_layers(counts: Sequence[float]) -> list[list[int]]:
    """``[stage] -> global indices of every layer it holds a part of`` (a split layer on both stages)."""
    return [[part.layer for part in parts] for parts in stage_parts(counts)]
