"""How many transformer layers each pipeline stage should hold, given what layers and heads cost.

A persistent slow stage (an output head over a 50k vocabulary, the embedding, a slower GPU) is
on every schedule's critical path: no order of ops hides work that one stage has and the others
do not (docs/schedules.md measures it). The fix is to move layers, which is what
:func:`balanced_split` computes: the split whose slowest stage is fastest, both free (any count per
stage) and as Megatron-LM can express it (``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``, the middle stages even; ``trainer.layer_split`` states its
rules). Pure: the benchmark and the simulator CLI (``--layers ... --resplit``) both call it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.layer_split import FIRST_FLAG, LAST_FLAG, layers_per_stage, split_problems
from trainer.problems import raise_if_any


@dataclass(frozen=True)
class LayerCosts:
    """Measured (or estimated) compute of the parts of a model, in any one unit."""

    num_layers: int
    """Transformer layers of the whole model."""
    layer: float = 1.0
    """One layer's forward + backward time."""
    embedding: float = 0.0
    """Extra time of the first stage: the embedding (and its gradient)."""
    head: float = 0.0
    """Extra time of the last stage: output head and loss (about two layers at hidden 2048 and a
    50k vocabulary, docs/benchmarks.md#reference-megatron-core-alone-on-4-h200s)."""
    stage_speed: tuple[float, ...] = ()
    """Slowdown of each stage (1.2 = that GPU runs 20% slower); empty: all 1."""

    def __post_init__(self) -> None:
        problems = []
        if self.num_layers < 1:
            problems.append(f"num_layers={self.num_layers} must be >= 1")
        if not (math.isfinite(self.layer) and self.layer > 0):
            problems.append(f"layer={self.layer} must be a finite number > 0")
        for name in ("embedding", "head"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name}={value} must be a finite number >= 0")
        bad = [x for x in self.stage_speed if not (math.isfinite(x) and x > 0)]
        if bad:
            problems.append(f"stage_speed={self.stage_speed} has values that are not finite numbers > 0: {bad}")
        raise_if_any(problems, "invalid layer costs")

    def stage_cost(self, stage: int, num_stages: int, layers: int) -> float:
        extra = (self.embedding if stage == 0 else 0.0) + (self.head if stage == num_stages - 1 else 0.0)
        speed = self.stage_speed[stage] if self.stage_speed else 1.0
        return speed * (layers * self.layer + extra)

    def stage_costs(self, layers: Sequence[int]) -> list[float]:
        """Each stage's time for ``layers[s]`` layers on stage ``s``."""
        if self.stage_speed and len(self.stage_speed) != len(layers):
            raise ValueError(f"stage_speed has {len(self.stage_speed)} entries for {len(layers)} stages")
        return [self.stage_cost(s, len(layers), n) for s, n in enumerate(layers)]

    def stage_scale(self, layers: Sequence[int]) -> tuple[float, ...]:
        """Stage costs relative to an even split without embedding or head (the simulator's
        unit: ``CostModel.stage_scale``)."""
        even = self.num_layers * self.layer / len(layers)
        return tuple(c / even for c in self.stage_costs(layers))


@dataclass(frozen=True)
class LayerSplit:
    """A layer count per stage, with its stage costs and, when Megatron can lay it out, its flags."""

    layers: tuple[int, ...]
    stage_costs: tuple[float, ...]
    first: int | None = None
    """``--decoder-first-pipeline-num-layers``, or None (not needed or not expressible)."""
    last: int | None = None
    """``--decoder-last-pipeline-num-layers``, or None."""
    megatron: bool = True
    """Whether Megatron-LM's two flags express ``layers`` (else it needs a custom layout)."""

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs)

    def flags(self) -> list[str]:
        """Megatron-LM's command-line flags for this split ([] for the even split)."""
        if not self.megatron:
            raise ValueError(f"layers {list(self.layers)} cannot be expressed with {FIRST_FLAG} / {LAST_FLAG}")
        out = []
        if self.first is not None:
            out += [FIRST_FLAG, str(self.first)]
        if self.last is not None:
            out += [LAST_FLAG, str(self.last)]
        return out

    def describe(self) -> str:
        layout = "/".join(map(str, self.layers))
        costs = ", ".join(f"{c:.2f}" for c in self.stage_costs)
        flags = " ".join(self.flags()) or "(even: no flags)" if self.megatron else "(not expressible by Megatron's flags)"
        return f"{layout} layers, stage costs {costs} (slowest {self.bottleneck:.2f}); {flags}"


def split_of(costs: LayerCosts, layers: Sequence[int], num_chunks: int = 1) -> LayerSplit:
    """``layers`` as a :class:`LayerSplit` (its stage costs, and Megatron's flags if any)."""
    layers = tuple(layers)
    flags = _as_megatron(layers, costs.num_layers, len(layers), num_chunks)
    first, last = flags if flags else (None, None)
    return LayerSplit(layers, tuple(costs.stage_costs(layers)), first, last, megatron=flags is not None)


def _key(split_costs: list[float]) -> tuple[float, ...]:
    # Slowest stage first, then the next slowest...: among equal bottlenecks, the flatter split.
    return tuple(round(c, 9) for c in sorted(split_costs, reverse=True))


def balanced_split(costs: LayerCosts, num_stages: int, num_chunks: int = 1,
                   megatron_flags: bool = True) -> LayerSplit:
    """The layer split whose slowest stage is fastest.

    ``megatron_flags``: only splits that Megatron-LM's first/last-stage flags express (middle
    stages even, every count divisible by ``num_chunks``); else any count per stage (a multiple
    of ``num_chunks``, at least one layer per chunk), found by trying every bottleneck value.
    """
    p, v, n = num_stages, num_chunks, costs.num_layers
    if p < 1 or v < 1:
        raise ValueError(f"num_stages={p} and num_chunks={v} must be >= 1")
    if costs.stage_speed and len(costs.stage_speed) != p:
        raise ValueError(f"stage_speed has {len(costs.stage_speed)} entries, need num_stages={p}")
    if n < p * v:
        raise ValueError(f"num_layers={n} < num_stages * num_chunks = {p * v}: a chunk needs a layer")
    if megatron_flags:
        return _best_megatron_split(costs, p, v)
    return _best_free_split(costs, p, v)


def _best_megatron_split(costs: LayerCosts, p: int, v: int) -> LayerSplit:
    options: list[tuple[int | None, int | None]] = [(None, None)]
    if p > 1:
        counts = [None, *range(v, costs.num_layers + 1, v)]
        options = [(first, last) for first in counts for last in counts]
    best = None
    for first, last in options:
        if split_problems(costs.num_layers, p, v, first, last):
            continue
        layers = layers_per_stage(costs.num_layers, p, first, last)
        if min(layers) < v:
            continue
        stage_costs = costs.stage_costs(layers)
        key = (_key(stage_costs), first is not None, last is not None)  # fewer flags on ties
        if best is None or key < best[0]:
            best = (key, LayerSplit(tuple(layers), tuple(stage_costs), first, last))
    if best is None:
        raise ValueError(f"no Megatron layout of {costs.num_layers} layers on {p} stages x {v} chunks")
    return best[1]


def _best_free_split(costs: LayerCosts, p: int, v: int) -> LayerSplit:
    n = costs.num_layers
    if n % v:
        raise ValueError(f"num_layers={n} is not divisible by num_chunks={v}")
    units = n // v  # layers move between stages v at a time (one per chunk)
    candidates = sorted({costs.stage_cost(s, p, k * v) for s in range(p) for k in range(1, units + 1)})
    for bound in candidates:  # the smallest bottleneck for which every layer finds a stage
        room = [max((k for k in range(1, units + 1) if costs.stage_cost(s, p, k * v) <= bound + 1e-12),
                    default=0) for s in range(p)]
        if min(room) >= 1 and sum(room) >= units:
            break
    else:  # pragma: no cover - the largest candidate always fits
        raise AssertionError("no bound fits")
    counts = list(room)
    while sum(counts) > units:  # give back surplus from the stages that would run slowest
        s = max((s for s in range(p) if counts[s] > 1),
                key=lambda s: (costs.stage_cost(s, p, counts[s] * v), s))
        counts[s] -= 1
    counts = _flatten(costs, counts, p, v)
    return split_of(costs, [k * v for k in counts], v)


def _flatten(costs: LayerCosts, counts: list[int], p: int, v: int) -> list[int]:
    """Move one chunk's layers at a time while that makes the sorted stage costs smaller: among
    splits with the same slowest stage, the one whose next slowest is fastest (and so on)."""
    def key(c: list[int]) -> tuple[float, ...]:
        return _key([costs.stage_cost(s, p, k * v) for s, k in enumerate(c)])

    best = key(counts)
    while True:
        moves = [(key(c), c) for s in range(p) for t in range(p) if s != t and counts[s] > 1
                 for c in [[k - (i == s) + (i == t) for i, k in enumerate(counts)]]]
        new_key, new_counts = min(moves, default=(best, counts))
        if new_key >= best:
            return counts
        best, counts = new_key, new_counts


def _as_megatron(layers: tuple[int, ...], n: int, p: int, v: int) -> tuple[int | None, int | None] | None:
    """(first, last) flags that lay ``layers`` out in Megatron-LM, or None if none do."""
    for first in (None, layers[0]):
        for last in (None, layers[-1]):
            if p > 1 and sum(layers) == n and not split_problems(n, p, v, first, last) \
                    and tuple(layers_per_stage(n, p, first, last)) == layers:
                return first, last
    return (None, None) if p == 1 else None
