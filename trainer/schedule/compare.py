"""Run schedules on the same random cost draws and summarise them against 1F1B (CLI, tests, docs).

Seed ``i`` draws the per-microbatch sequence lengths identically for every schedule (they are drawn
first), so schedules are compared on the same workload; 1F1B is always run as the baseline, at one
chunk per stage. Ratios are per-seed ``1F1B step / schedule step`` (> 1: faster than 1F1B), and
the reported figure is their median over seeds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer.schedule.bound import OrderFreeBound, order_free_bound
from trainer.schedule.core import PipelineShape, Policy
from trainer.schedule.costs import CostModel, CostTable
from trainer.schedule.registry import make_policy
from trainer.schedule.simulator import SimResult, simulate


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule to simulate: a registry name, its chunks per stage and its options."""

    name: str
    """Registry name (``make_policy``)."""
    num_chunks: int = 1
    """Model chunks per stage (v) this schedule runs with."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options passed to ``make_policy`` for every stage."""
    held_caps: tuple[int, ...] = ()
    """A dynamic policy's held cap per stage, set after it is built (as the runtime sets a held cap fitted
    to memory, trainer/pipeline/stage_graphs.py); empty: the options' caps."""

    def policies(self, num_stages: int, num_microbatches: int) -> tuple[PipelineShape, list[Policy]]:
        shape = PipelineShape(num_stages, num_microbatches, self.num_chunks)
        policies = [make_policy(self.name, shape, s, **self.options) for s in range(num_stages)]
        if self.held_caps:
            if len(self.held_caps) != num_stages:
                raise ValueError(f"held caps {self.held_caps}: one per stage ({num_stages})")
            for policy, cap in zip(policies, self.held_caps, strict=True):
                policy.cap = cap
        return shape, policies


@dataclass(frozen=True)
class Summary:
    """Medians over seeds of one schedule's simulated steps."""

    spec: ScheduleSpec
    step_time: float
    """Median step time (cost units)."""
    speedup: float
    """Median over seeds of 1F1B's step time / this schedule's (> 1: faster than 1F1B)."""
    bubble: float
    """Median bubble fraction."""
    peak_activations: float
    """Largest per-stage activation peak over all seeds, in whole-stage microbatch units."""
    caps: str
    """Per-stage caps as "held/live" in chunk units ("-" for static schedules)."""
    vs_bound: float = 0.0
    """Median over seeds of this schedule's step / the order-free bound of the same draw (>= 1;
    trainer/schedule/bound.py): what its order costs over the shortest step any order could run."""
    bound: OrderFreeBound | None = None
    """The order-free bound of the first seed's draw (at this schedule's chunks per stage)."""
    pool: str = ""
    """With the backward pool priced (host-time model): per stage, the medians over seeds of W's read in
    place / evacuations / W's run early, e.g. "64/0/0,58/6/0"; empty otherwise, or with no split backward."""


Simulator = Callable[..., SimResult]
"""``simulate`` (decisions at GPU time) or a partial of ``host_ahead.simulate_host_ahead``."""


def draw(spec: ScheduleSpec, num_stages: int, num_microbatches: int, costs: CostModel, seed: int) -> CostTable:
    """Seed ``seed``'s op costs for ``spec``'s shape: what :func:`run_once` simulates (and
    :func:`~trainer.schedule.bound.order_free_bound` bounds)."""
    return costs.draw(PipelineShape(num_stages, num_microbatches, spec.num_chunks), np.random.default_rng(seed))


def run_once(spec: ScheduleSpec, num_stages: int, num_microbatches: int, costs: CostModel,
             seed: int, record: bool = False, simulator: Simulator = simulate,
             table: CostTable | None = None) -> SimResult:
    """One simulated step of ``spec`` on seed ``seed``'s draw (``table``: that draw, already made)."""
    shape, policies = spec.policies(num_stages, num_microbatches)
    if table is None:
        table = draw(spec, num_stages, num_microbatches, costs, seed)
    return simulator(shape, policies, table, record=record)


def describe_caps(policies: list[Policy]) -> str:
    caps = [getattr(p, "cap", None) for p in policies]
    if any(c is None for c in caps):
        return "-"
    lives = [getattr(p, "live_cap", None) for p in policies]
    # A stage with no live cap (dpp per stage; dpp-zb's stage 0, which runs whole backwards) shows its held
    # cap alone; per-chunk caps follow in brackets.
    texts = [str(c) if live is None else f"{c}/{live}" for c, live in zip(caps, lives, strict=True)]
    chunk_caps = [getattr(p, "chunk_caps", None) for p in policies]
    return ",".join(text if c is None else f"{text}[{'+'.join(map(str, c))}]"
                    for text, c in zip(texts, chunk_caps, strict=True))


def compare(specs: list[ScheduleSpec], num_stages: int, num_microbatches: int, costs: CostModel,
            seeds: list[int], simulator: Simulator = simulate) -> tuple[Summary, list[Summary]]:
    """(1F1B baseline, one summary per spec), all over the same ``seeds`` and ``simulator``."""
    if not seeds:
        raise ValueError("need at least one seed")
    baseline_spec = ScheduleSpec("1f1b")
    base_steps = [run_once(baseline_spec, num_stages, num_microbatches, costs, s, simulator=simulator).step_time
                  for s in seeds]
    results = [_summarise(baseline_spec, num_stages, num_microbatches, costs, seeds, base_steps, simulator)]
    results += [_summarise(spec, num_stages, num_microbatches, costs, seeds, base_steps, simulator) for spec in specs]
    return results[0], results[1:]


def _summarise(spec: ScheduleSpec, num_stages: int, num_microbatches: int, costs: CostModel,
               seeds: list[int], base_steps: list[float], simulator: Simulator) -> Summary:
    tables = [draw(spec, num_stages, num_microbatches, costs, s) for s in seeds]
    runs = [run_once(spec, num_stages, num_microbatches, costs, s, simulator=simulator, table=t)
            for s, t in zip(seeds, tables, strict=True)]
    bounds = [order_free_bound(t) for t in tables]
    _, policies = spec.policies(num_stages, num_microbatches)
    return Summary(
        spec=spec,
        step_time=statistics.median(r.step_time for r in runs),
        speedup=statistics.median(b / r.step_time for b, r in zip(base_steps, runs, strict=True)),
        bubble=statistics.median(r.bubble_fraction for r in runs),
        peak_activations=max(r.peak_activations for r in runs),
        caps=describe_caps(policies),
        vs_bound=statistics.median(r.step_time / b.step for r, b in zip(runs, bounds, strict=True)),
        bound=bounds[0],
        pool=describe_pool(runs),
    )


def describe_pool(runs: list[SimResult]) -> str:
    """:attr:`Summary.pool` of these runs ("" when the pool was not priced, or no W ran)."""
    if any(r.pool_counts is None or not any(map(any, r.pool_counts)) for r in runs):
        return ""
    stages = zip(*(r.pool_counts for r in runs), strict=True)
    return ",".join("/".join(f"{statistics.median(seed[k] for seed in per_seed):g}" for k in range(3))
                    for per_seed in stages)
