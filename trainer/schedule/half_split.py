"""The balanced pipeline split in half layers: ``--pipeline-stage-layers 4.5,4,4,3.5`` (pure, no torch).

Why: with whole layers the slowest stage of a small model stays far above the mean (16 layers on 4
stages with a heavy output head: docs/schedules.md, "Is ≤ 1.12× reachable?"); a stage boundary
between a layer's attention and its MLP (trainer/schedule/stage_parts.py) halves the unit a split
moves. The units alternate: unit ``2k`` is layer ``k``'s attention half, ``2k + 1`` its MLP half,
costing ``attention_share`` and ``1 - attention_share`` of a layer (:class:`LayerCosts`); the
embedding is stage 0's, the head the last stage's, a slower GPU multiplies its stage.

:func:`balanced_half_split` is exact over every contiguous partition of the units into non-empty
stages: first the smallest bottleneck (a min-max dynamic programme over (stage, end unit), vectorised
over the start), then, among the partitions within that bottleneck, the one :func:`balanced_split`'s
order prefers -- the sorted stage costs slowest first, then fewer boundaries inside a layer, then the
split closest to even. That order is a dynamic programme too: adding the same stage to two prefixes
keeps their order, so the best prefix per (stage, end unit) is all a longer split needs. Where
Megatron-LM's first/last flags lay out a split as good, that split is returned (users know the flags).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np

from trainer.problems import raise_if_any
from trainer.schedule.layers import LayerCosts, LayerSplit, balanced_split, cost_key, split_of
from trainer.schedule.stage_parts import STAGE_LAYERS_FLAG, layer_count
from trainer.schedule.stage_parts import describe as describe_counts


def balanced_half_split(costs: LayerCosts, num_stages: int) -> LayerSplit:
    """The split in whole or half layers whose slowest stage is fastest (ties: flatter, then fewer
    boundaries inside a layer, then closer to even); Megatron's flags where they express one as good."""
    p, n = num_stages, costs.num_layers
    problems = [f"num_stages={p} must be >= 1"] if p < 1 else []
    if costs.attention_share is None:
        problems.append("a split in half layers needs the attention half's share of a layer (LayerCosts.attention_share)")
    if p >= 1 and 2 * n < p:
        problems.append(f"num_layers={n} has {2 * n} half layers for num_stages={p}: a stage needs at least one")
    if costs.stage_speed and len(costs.stage_speed) != p:
        problems.append(f"stage_speed has {len(costs.stage_speed)} entries, need num_stages={p}")
    raise_if_any(problems, "no balanced split in half layers")
    cost = _interval_costs(costs, p)
    bound = _min_bottleneck(cost)
    units = _lexicographic_best(cost, bound, n)
    split = split_of(costs, [u / 2 for u in units])
    whole = _megatron_alternative(costs, p)
    return whole if whole is not None and cost_key(list(whole.stage_costs)) <= cost_key(list(split.stage_costs)) else split


def _interval_costs(costs: LayerCosts, p: int) -> np.ndarray:
    """``cost[s, i, j]``: stage ``s`` holding units ``[i, j)`` (inf where j <= i), by the formula of
    :meth:`LayerCosts.parts_cost`, so the split found compares exactly with the splits it reports."""
    units = np.arange(2 * costs.num_layers + 1)
    attention = (units[None, :] + 1) // 2 - (units[:, None] + 1) // 2  # even units of [i, j)
    mlp = units[None, :] - units[:, None] - attention
    share = costs.attention_share
    halves = np.where(attention == mlp, attention * costs.layer,
                      (attention * share + mlp * (1.0 - share)) * costs.layer)
    out = np.empty((p, len(units), len(units)))
    for s in range(p):
        extra = (costs.embedding if s == 0 else 0.0) + (costs.head if s == p - 1 else 0.0)
        speed = costs.stage_speed[s] if costs.stage_speed else 1.0
        out[s] = np.where(units[None, :] > units[:, None], speed * (halves + extra), np.inf)
    return out


def _min_bottleneck(cost: np.ndarray) -> float:
    """The smallest slowest-stage time over all partitions of the units into ``p`` non-empty stages."""
    p, size, _ = cost.shape
    best = cost[0, 0, :].copy()  # stage 0 ends at unit j
    for s in range(1, p):
        best = np.maximum(best[:, None], cost[s]).min(axis=0)
    return float(best[-1])


def _lexicographic_best(cost: np.ndarray, bound: float, num_layers: int) -> list[int]:
    """Units per stage of the best partition with every stage within ``bound``, in :func:`balanced_split`'s
    order (sorted stage costs, then boundaries inside a layer, then squared distance from the even count)."""
    p, size, _ = cost.shape
    limit = bound * (1 + 1e-12) + 1e-12
    even = num_layers / p
    # best[j] = (key, units per stage) of the best prefix of stages ending at unit j
    best: dict[int, tuple[tuple, list[int]]] = {0: (((), 0, 0.0), [])}
    for s in range(p):
        ends = range(size - 1, size) if s == p - 1 else range(s + 1, size - (p - s - 1))
        nxt: dict[int, tuple[tuple, list[int]]] = {}
        for j in ends:
            for i in (int(i) for i in np.nonzero(cost[s, :, j] <= limit)[0] if int(i) in best):
                (stage_costs, inside, moved), counts = best[i]
                c = round(float(cost[s, i, j]), 9)
                key = (tuple(sorted((*stage_costs, c), reverse=True)), inside + (j % 2),
                       round(moved + ((j - i) / 2 - even) ** 2, 9))
                if j not in nxt or key < nxt[j][0]:
                    nxt[j] = (key, [*counts, j - i])
        best = nxt
    assert size - 1 in best, "the bound comes from a feasible partition"
    return best[size - 1][1]


def _megatron_alternative(costs: LayerCosts, p: int) -> LayerSplit | None:
    """:func:`balanced_split`'s Megatron layout, or None where it has none for these stages."""
    if costs.num_layers < p:
        return None
    try:
        return balanced_split(costs, p)
    except ValueError:  # no first/last layout of these layers: the half split stands alone
        return None


CHUNK_SEARCH_KICKS = 300
"""Restarts of :func:`balanced_chunk_split`'s descent from a kicked best split (about 0.6 s for 64
layers on 8 stages x 2 chunks)."""


@dataclass(frozen=True)
class ChunkSplit:
    """A split with ``v`` model chunks per stage: one layer count per virtual stage, in model order
    (chunk ``c`` of stage ``s`` at ``c * p + s``, as ``--pipeline-stage-layers`` takes them), with what
    each chunk and each stage (its chunks together) costs."""

    layers: tuple[float, ...]
    num_stages: int
    chunk_costs: tuple[float, ...]

    @property
    def stage_costs(self) -> tuple[float, ...]:
        p = self.num_stages
        return tuple(sum(self.chunk_costs[s::p]) for s in range(p))

    @property
    def bottleneck(self) -> float:
        """The slowest stage, all its chunks together: no order ends a step before it."""
        return max(self.stage_costs)

    def trainer_flags(self) -> list[str]:
        return [STAGE_LAYERS_FLAG, describe_counts(self.layers, ",")]

    def describe(self) -> str:
        costs = ", ".join(f"{c:.2f}" for c in self.stage_costs)
        return (f"{describe_counts(self.layers)} layers per virtual stage, stage costs {costs} (slowest "
                f"{self.bottleneck:.2f}, slowest chunk {max(self.chunk_costs):.2f}); {' '.join(self.trainer_flags())}")


def chunk_split_of(costs: LayerCosts, layers: tuple[float, ...] | list[float], num_stages: int) -> ChunkSplit:
    """``layers`` (one count per virtual stage, model order) as a :class:`ChunkSplit`: the embedding is
    the first virtual stage's, the head the last one's, a slower GPU slows each of its chunks."""
    layers = tuple(map(layer_count, layers))
    return ChunkSplit(layers, num_stages, tuple(_virtual_costs(costs, num_stages, len(layers)).stage_costs(layers)))


def chunks_of_stages(layers: tuple[float, ...] | list[float], num_chunks: int) -> tuple[float, ...]:
    """A split per stage (every chunk of a stage alike, as megatron-core lays out whole layers) as counts
    per virtual stage in model order."""
    return tuple(layer_count(n / num_chunks) for _ in range(num_chunks) for n in layers)


def balanced_chunk_split(costs: LayerCosts, num_stages: int, num_chunks: int) -> ChunkSplit:
    """A split in half layers with ``num_chunks`` chunks per stage whose stages balance.

    Why: with whole layers megatron-core gives every chunk of a stage the same count and moves layers
    ``v`` at a time, so the last stage keeps the output head on top of its share (16 layers, 4 stages,
    2 chunks: 4/4/4/4, the last stage 1.26x the mean with the benchmark's head). Here each virtual
    stage gets its own count. The search starts from the split whose slowest *chunk* is fastest
    (exact: :func:`balanced_half_split`'s programme over the ``p * v`` virtual stages, the embedding
    on the first, the head on the last) and moves boundaries one half layer at a time while that makes
    the stages (their chunks together) flatter, slowest first, then the chunks; then it kicks the best
    split found (a few boundaries moved at random, seeded: the same split on every call) and descends
    again, :data:`CHUNK_SEARCH_KICKS` times. A stage's chunks lie apart in the model, so no programme
    like the one-chunk split's applies and the result is not proven optimal: against a brute force it
    found the optimum on the benchmark's costs (16 layers, 4 stages, 2 chunks) and came within 1.3% of
    it on small random models (tests/unit/test_half_split.py).
    """
    p, v, n = num_stages, num_chunks, costs.num_layers
    problems = [f"num_stages={p} and num_chunks={v} must be >= 1"] if p < 1 or v < 1 else []
    if costs.attention_share is None:
        problems.append("a split in half layers needs the attention half's share of a layer (LayerCosts.attention_share)")
    if not problems and 2 * n < p * v:
        problems.append(f"num_layers={n} has {2 * n} half layers for {p} stages x {v} chunks: a chunk needs one")
    if costs.stage_speed and len(costs.stage_speed) != p:
        problems.append(f"stage_speed has {len(costs.stage_speed)} entries, need num_stages={p}")
    raise_if_any(problems, "no balanced split in half layers per chunk")
    virtual = _virtual_costs(costs, p, p * v)
    cost = _interval_costs(virtual, p * v)
    units = _lexicographic_best(cost, _min_bottleneck(cost), n)

    def key(bounds: list[int]) -> tuple:
        chunk_costs = [float(cost[i, bounds[i], bounds[i + 1]]) for i in range(p * v)]
        return cost_key([sum(chunk_costs[s::p]) for s in range(p)]), cost_key(chunk_costs)

    def descend(bounds: list[int]) -> tuple[tuple, list[int]]:
        best = key(bounds)
        while True:
            moves = [b for i in range(1, p * v) for step in (-1, 1)
                     for b in [bounds[:i] + [bounds[i] + step] + bounds[i + 1:]] if b[i - 1] < b[i] < b[i + 1]]
            scored = min(((key(b), b) for b in moves), default=None)
            if scored is None or scored[0] >= best:
                return best, bounds
            best, bounds = scored

    best = descend(np.cumsum([0, *units]).tolist())
    rng = random.Random(0)  # the same split on every call
    for _ in range(CHUNK_SEARCH_KICKS):
        kicked = list(best[1])
        for _ in range(rng.choice((1, 2, 3))):
            i, step = rng.randrange(1, p * v), rng.choice((-2, -1, 1, 2))
            if kicked[i - 1] < kicked[i] + step < kicked[i + 1]:
                kicked[i] += step
        found = descend(kicked)
        if found[0] < best[0]:
            best = found
    bounds = best[1]
    return chunk_split_of(costs, [(hi - lo) / 2 for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)], p)


def _virtual_costs(costs: LayerCosts, p: int, num_virtual: int) -> LayerCosts:
    """``costs`` over ``num_virtual`` virtual stages in model order: each slowed by its GPU's speed."""
    speed = tuple(costs.stage_speed[i % p] for i in range(num_virtual)) if costs.stage_speed else ()
    return dataclasses.replace(costs, stage_speed=speed)
