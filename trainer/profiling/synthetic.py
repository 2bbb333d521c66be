"""Exact traces of non-interleaved 1F1B with uniform costs, for tests and documentation examples.

This is a closed-form reference, deliberately independent of trainer/schedule's simulator: with
forward time ``f``, backward time ``b`` and free communication, 1F1B's step lasts
``(m + p - 1)(f + b)`` and every stage is busy ``m (f + b)``, so its bubble is ``(p-1)/(m+p-1)``.
Tests use it to check the aggregator's arithmetic against that formula, and to fabricate per-rank
files (with skewed clocks, missing ranks...) without running a trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.problems import raise_if_any


@dataclass(frozen=True)
class UniformCosts:
    """Durations of one 1F1B step with uniform costs (µs)."""

    num_stages: int
    """p: pipeline stages."""
    num_microbatches: int
    """m: microbatches per step."""
    forward_us: float = 1000.0
    """Forward time of one microbatch on one stage."""
    backward_us: float = 2000.0
    """Backward time of one microbatch on one stage."""

    def __post_init__(self) -> None:
        bad = [f"{n}={getattr(self, n)}" for n in ("num_stages", "num_microbatches") if getattr(self, n) < 1]
        bad += [f"{n}={getattr(self, n)}" for n in ("forward_us", "backward_us") if not getattr(self, n) > 0]
        raise_if_any(bad, "invalid UniformCosts")


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s 1F1B order: warm-up forwards, then alternate F/B, then cool-down backwards."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", m) for m in range(warmup)]
    for k in range(num_microbatches - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def one_f_one_b_events(costs: UniformCosts, iteration: int = 0, start_us: float = 0.0) -> list[dict[str, Any]]:
    """Compute events of one 1F1B step, all stages, ``pid`` = stage, earliest-start timing."""
    p, m = costs.num_stages, costs.num_microbatches
    orders = [one_f_one_b_order(s, p, m) for s in range(p)]
    end: dict[tuple[str, int, int], float] = {}  # (op, microbatch, stage) -> end time
    position, free_at, inflight = [0] * p, [start_us] * p, [0] * p
    events: list[dict[str, Any]] = []
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            op, mb = orders[s][position[s]]
            dep = (("F", mb, s - 1) if s > 0 else None) if op == "F" else \
                  (("B", mb, s + 1) if s < p - 1 else ("F", mb, s))
            if dep is not None and dep not in end:
                continue  # its input has not been produced yet
            ts = max(free_at[s], end[dep] if dep else start_us)
            dur = costs.forward_us if op == "F" else costs.backward_us
            end[(op, mb, s)] = free_at[s] = ts + dur
            inflight[s] += 1 if op == "F" else -1
            events.append({"name": f"{op}{mb}.c0", "ph": "X", "ts": ts, "dur": dur, "pid": s,
                           "tid": "compute", "cat": op,
                           "args": {"iteration": iteration, "microbatch": mb, "chunk": 0, "stage": s,
                                    "inflight": inflight[s]}})
            position[s] += 1
            progressed = True
        assert progressed, "1F1B order deadlocked: bug in one_f_one_b_order"
    return events


def step_time_us(costs: UniformCosts) -> float:
    """(m + p - 1)(f + b): the exact step time of uniform-cost 1F1B."""
    return (costs.num_microbatches + costs.num_stages - 1) * (costs.forward_us + costs.backward_us)


def simulated_trace(costs: UniformCosts, iterations: int = 1, gap_us: float = 500.0) -> dict[str, Any]:
    """A simulator-shaped document: all stages in one file, ``metadata.source`` = "simulator"."""
    events = []
    for it in range(iterations):
        events += one_f_one_b_events(costs, iteration=it, start_us=it * (step_time_us(costs) + gap_us))
    return {"traceEvents": events, "metadata": {
        "rank": -1, "stage": -1, "tp_rank": 0, "dp_rank": 0, "world_size": costs.num_stages,
        "pipeline_parallel": costs.num_stages, "num_chunks": 1, "num_microbatches": costs.num_microbatches,
        "schedule": "1f1b", "source": "simulator", "clock_offset_us": 0.0}}


def rank_traces(costs: UniformCosts, iterations: int = 1, clock_skew_us: tuple[float, ...] = (),
                epoch_us: float = 1.7e15, run_id: str = "synthetic") -> dict[int, dict[str, Any]]:
    """Per-rank runtime-shaped documents (one rank per stage) of the same schedule.

    Rank r's clock reads ``clock_skew_us[r]`` µs ahead of rank 0's (missing entries: 0), so its
    events are shifted by that much and its metadata carries the offset that undoes it, exactly as
    a rank whose start-up clock sync measured the skew would write them. ``epoch_us`` places the
    run at a realistic wall-clock time (µs since 1970) so that large-timestamp arithmetic is tested.
    Every rank's metadata carries ``run_id``, as a real run's does.
    """
    base = simulated_trace(costs, iterations)
    documents = {}
    for rank in range(costs.num_stages):
        skew = clock_skew_us[rank] if rank < len(clock_skew_us) else 0.0
        events = [dict(e, ts=e["ts"] + epoch_us + skew, pid=rank) for e in base["traceEvents"]
                  if e["pid"] == rank]
        documents[rank] = {"traceEvents": events, "metadata": dict(
            base["metadata"], rank=rank, stage=rank, schedule="1f1b", source="runtime",
            clock_offset_us=-skew, run_id=run_id)}
    return documents
