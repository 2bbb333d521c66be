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

import numpy as np

from trainer.problems import raise_if_any
from trainer.schedule.layers import LayerCosts, LayerSplit, balanced_split, cost_key, split_of


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
