"""Per-stage busy/idle time, bubble fraction, iteration time and in-flight activations of a merged trace.

Definitions (docs/profiling.md):

* step time ``T`` of an iteration: latest end minus earliest start over the compute events
  (F/B/I/W) of all stages in that iteration;
* busy time of a stage: sum of its compute durations in the iteration; idle = ``T`` - busy;
* bubble fraction of a stage: ``1 - busy / T``; the trace's bubble fraction is the mean over
  stages, then over iterations. With uniform costs and 1F1B this is ``(p-1)/(m+p-1)``;
* peak in-flight activations: the largest ``args.inflight`` a stage reported, or, where the trace
  has none, the largest count of forwards whose backward had not finished, replayed in time order.

Stages with several ranks (data/tensor-parallel replicas) report the mean over their ranks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.profiling.validate import COMPUTE_CATEGORIES

US_PER_MS = 1000.0


@dataclass
class StageSummary:
    """One pipeline stage, averaged over the iterations summarised."""

    stage: int
    ranks: list[int]
    """Ranks holding this stage (empty for simulated traces)."""
    busy_ms: float
    """Mean compute time per iteration."""
    idle_ms: float
    """Mean step time minus busy time."""
    bubble_fraction: float
    """Mean of ``1 - busy / T`` over iterations."""
    wait_ms: float
    """Mean time per iteration spent in traced waits for the transport."""
    peak_inflight: int
    """Most activations held at once, over all iterations."""


@dataclass
class TraceSummary:
    """What the aggregation job prints and writes to ``summary.json``."""

    schedule: str
    source: str
    pipeline_parallel: int
    num_microbatches: int
    num_chunks: int
    iterations: list[int]
    """Iterations summarised (all traced ones, or the one asked for)."""
    iteration_time_ms: dict[int, float]
    """Step time ``T`` of each iteration."""
    bubble_fraction_by_iteration: dict[int, float]
    stages: list[StageSummary]
    median_op_ms: dict[str, float] = field(default_factory=dict)
    """Median duration of each compute kind (F, B, I, W) over all stages: the costs to give the
    simulator (``--forward``, ``--input-grad``/``--weight-grad``) to compare it with this run."""
    missing_ranks: list[int] = field(default_factory=list)

    @property
    def mean_iteration_time_ms(self) -> float:
        return statistics.fmean(self.iteration_time_ms.values())

    @property
    def bubble_fraction(self) -> float:
        """Mean over iterations of the mean over stages of ``1 - busy / T``."""
        return statistics.fmean(self.bubble_fraction_by_iteration.values())

    @property
    def theoretical_1f1b_bubble(self) -> float:
        """(p-1)/(m+p-1): 1F1B's bubble at uniform costs and v=1, the usual yardstick."""
        p, m = self.pipeline_parallel, self.num_microbatches
        return (p - 1) / (m + p - 1)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["iteration_time_ms"] = {str(k): v for k, v in self.iteration_time_ms.items()}
        out["bubble_fraction_by_iteration"] = {str(k): v for k, v in self.bubble_fraction_by_iteration.items()}
        out.update(mean_iteration_time_ms=self.mean_iteration_time_ms, bubble_fraction=self.bubble_fraction,
                   theoretical_1f1b_bubble=self.theoretical_1f1b_bubble)
        return out


def _replayed_peak(events: Iterable[dict[str, Any]]) -> int:
    """Peak activations held, from F (+1) and B/W (-1) in time order; ties release first."""
    held = peak = 0
    for event in sorted(events, key=lambda e: (e["ts"] + e["dur"], e["cat"] == "F")):
        if event["cat"] == "F":
            held += 1
            peak = max(peak, held)
        elif event["cat"] in ("B", "W"):
            held -= 1
    return peak


def _median_op_ms(events: Iterable[dict[str, Any]]) -> dict[str, float]:
    durations: dict[str, list[float]] = defaultdict(list)
    for e in events:
        durations[e["cat"]].append(e["dur"])
    return {cat: statistics.median(durations[cat]) / US_PER_MS for cat in COMPUTE_CATEGORIES if durations[cat]}


def iterations_of(merged: dict[str, Any]) -> list[int]:
    """Iterations that have compute events, ascending."""
    return sorted({e["args"]["iteration"] for e in merged["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") in COMPUTE_CATEGORIES})


def summarize(merged: dict[str, Any], iteration: int | None = None) -> TraceSummary:
    """Summary of all iterations in ``merged``, or of ``iteration`` alone; ValueError if absent."""
    traced = iterations_of(merged)
    if not traced:
        raise ValueError("the trace has no compute (F/B/I/W) events to summarise")
    if iteration is not None and iteration not in traced:
        raise ValueError(f"--iteration {iteration} is not in the trace (traced: {traced})")
    wanted = set(traced if iteration is None else [iteration])
    compute: dict[int, list[dict[str, Any]]] = defaultdict(list)  # iteration -> events
    waits: dict[tuple[int, int], float] = defaultdict(float)  # (stage, iteration) -> µs
    ranks_of_stage: dict[int, set[int]] = defaultdict(set)
    pids_of_stage: dict[int, set[int]] = defaultdict(set)
    for event in merged["traceEvents"]:
        if event.get("ph") != "X" or event["args"].get("iteration") not in wanted:
            continue
        stage = int(event["args"]["stage"])
        pids_of_stage[stage].add(event["pid"])
        if "rank" in event["args"]:
            ranks_of_stage[stage].add(int(event["args"]["rank"]))
        if event["cat"] in COMPUTE_CATEGORIES:
            compute[event["args"]["iteration"]].append(event)
        elif event["cat"] == "wait":
            waits[(stage, event["args"]["iteration"])] += event["dur"]

    stages = sorted(pids_of_stage)
    step_us: dict[int, float] = {}
    busy_us: dict[tuple[int, int], float] = {}  # (stage, iteration) -> mean over the stage's ranks
    for it, events in sorted(compute.items()):
        step_us[it] = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
        per_pid: dict[int, float] = defaultdict(float)
        for e in events:
            per_pid[e["pid"]] += e["dur"]
        for stage in stages:
            busy_us[(stage, it)] = statistics.fmean(per_pid.get(pid, 0.0) for pid in pids_of_stage[stage])

    def bubble(stage: int, it: int) -> float:
        return 1.0 - busy_us[(stage, it)] / step_us[it] if step_us[it] > 0 else 0.0

    summaries = []
    for stage in stages:
        its = sorted(step_us)
        stage_events = [e for it in its for e in compute[it] if int(e["args"]["stage"]) == stage]
        reported = [int(e["args"]["inflight"]) for e in stage_events if "inflight" in e["args"]]
        if reported:
            peak = max(reported)
        else:
            peak = max(_replayed_peak(e for e in stage_events if e["pid"] == pid and e["args"]["iteration"] == it)
                       for pid in pids_of_stage[stage] for it in its)
        summaries.append(StageSummary(
            stage=stage, ranks=sorted(ranks_of_stage[stage]),
            busy_ms=statistics.fmean(busy_us[(stage, it)] for it in its) / US_PER_MS,
            idle_ms=statistics.fmean(step_us[it] - busy_us[(stage, it)] for it in its) / US_PER_MS,
            bubble_fraction=statistics.fmean(bubble(stage, it) for it in its),
            wait_ms=statistics.fmean(waits[(stage, it)] / max(len(pids_of_stage[stage]), 1) for it in its)
            / US_PER_MS,
            peak_inflight=peak,
        ))
    meta = merged.get("metadata") or {}
    return TraceSummary(
        schedule=str(meta.get("schedule", "?")), source=str(meta.get("source", "?")),
        pipeline_parallel=int(meta.get("pipeline_parallel", len(stages))),
        num_microbatches=int(meta.get("num_microbatches", 0)), num_chunks=int(meta.get("num_chunks", 1)),
        iterations=sorted(step_us),
        iteration_time_ms={it: t / US_PER_MS for it, t in step_us.items()},
        bubble_fraction_by_iteration={it: statistics.fmean(bubble(s, it) for s in stages) for it in step_us},
        stages=summaries, missing_ranks=list(meta.get("missing_ranks", [])),
        median_op_ms=_median_op_ms(e for events in compute.values() for e in events),
    )


def format_table(summary: TraceSummary) -> str:
    """The table the aggregation CLI prints."""
    times = list(summary.iteration_time_ms.values())
    its = summary.iterations
    lines = [
        f"schedule {summary.schedule} ({summary.source}): PP={summary.pipeline_parallel} "
        f"M={summary.num_microbatches} v={summary.num_chunks}; iterations {its[0]}..{its[-1]} ({len(its)})",
        f"iteration time: mean {summary.mean_iteration_time_ms:.2f} ms (min {min(times):.2f}, max {max(times):.2f})",
        f"bubble fraction: {summary.bubble_fraction:.4f} (1F1B theory (p-1)/(m+p-1) = "
        f"{summary.theoretical_1f1b_bubble:.4f})",
        "median op time: " + ", ".join(f"{cat} {ms:.2f} ms" for cat, ms in summary.median_op_ms.items()),
        "",
        f"{'stage':>5} {'ranks':>10} {'busy ms':>10} {'idle ms':>10} {'bubble':>7} {'wait ms':>9} {'peak inflight':>13}",
    ]
    for s in summary.stages:
        ranks = ",".join(map(str, s.ranks)) if s.ranks else "sim"
        lines.append(f"{s.stage:>5} {ranks:>10} {s.busy_ms:>10.2f} {s.idle_ms:>10.2f} {s.bubble_fraction:>7.4f} "
                     f"{s.wait_ms:>9.2f} {s.peak_inflight:>13d}")
    if summary.missing_ranks:
        lines.append(f"missing ranks (no trace): {', '.join(map(str, summary.missing_ranks))}")
    return "\n".join(lines)
