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
from trainer.schedule.stage_parts import layer_count

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
    gpu_busy_ms: float | None = None
    """Mean GPU time of the stage's ops per iteration, from CUDA events ("gpu" spans; CUDA runs
    only)."""
    gpu_idle_ms: float | None = None
    """Mean GPU step time (first to last gpu span of the iteration, all stages) minus ``gpu_busy_ms``:
    the time this stage's GPU waited, for inputs or for its host. (The host's ``T`` does not serve:
    a host that runs ahead finishes enqueuing long before its GPU finishes.)"""


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
    stage_busy_ms: dict[int, list[float]] = field(default_factory=dict)
    """iteration -> each stage's compute time in it (GPU time of its ops where the trace has gpu
    spans, else host compute spans; mean over the stage's ranks): what the stage balance is fitted to."""
    layers_per_stage: list[float] = field(default_factory=list)
    """The run's layer split (runtime traces record it; x.5 under --pipeline-stage-layers: a stage boundary
    inside a layer); empty where the trace does not say."""

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
        out["stage_busy_ms"] = {str(k): v for k, v in self.stage_busy_ms.items()}
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


@dataclass
class _Grouped:
    """The events of the iterations being summarised, grouped the ways the summary needs them."""

    compute: dict[int, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    """iteration -> compute (F/B/I/W) events."""
    wait_us: dict[tuple[int, int], float] = field(default_factory=lambda: defaultdict(float))
    """(stage, iteration) -> traced wait time, summed over the stage's ranks."""
    gpu_us: dict[tuple[int, int], float] = field(default_factory=lambda: defaultdict(float))
    """(stage, iteration) -> GPU time of the ops ("gpu" spans), summed over the stage's ranks."""
    gpu_window: dict[int, tuple[float, float]] = field(default_factory=dict)
    """iteration -> (first start, last end) of its gpu spans over all stages."""
    ranks_of_stage: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    pids_of_stage: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))

    @property
    def stages(self) -> list[int]:
        return sorted(self.pids_of_stage)


def _group(merged: dict[str, Any], wanted: set[int]) -> _Grouped:
    grouped = _Grouped()
    for event in merged["traceEvents"]:
        if event.get("ph") != "X" or event["args"].get("iteration") not in wanted:
            continue
        stage, iteration = int(event["args"]["stage"]), event["args"]["iteration"]
        grouped.pids_of_stage[stage].add(event["pid"])
        if "rank" in event["args"]:
            grouped.ranks_of_stage[stage].add(int(event["args"]["rank"]))
        if event["cat"] in COMPUTE_CATEGORIES:
            grouped.compute[iteration].append(event)
        elif event["cat"] == "wait":
            grouped.wait_us[(stage, iteration)] += event["dur"]
        elif event["cat"] == "gpu":
            grouped.gpu_us[(stage, iteration)] += event["dur"]
            lo, hi = grouped.gpu_window.get(iteration, (event["ts"], event["ts"] + event["dur"]))
            grouped.gpu_window[iteration] = (min(lo, event["ts"]), max(hi, event["ts"] + event["dur"]))
    return grouped


def _busy_us(grouped: _Grouped) -> dict[tuple[int, int], float]:
    """(stage, iteration) -> compute time, mean over the stage's ranks."""
    busy = {}
    for it, events in grouped.compute.items():
        per_pid: dict[int, float] = defaultdict(float)
        for e in events:
            per_pid[e["pid"]] += e["dur"]
        for stage in grouped.stages:
            busy[(stage, it)] = statistics.fmean(per_pid.get(pid, 0.0) for pid in grouped.pids_of_stage[stage])
    return busy


def _peak_inflight(grouped: _Grouped, stage: int) -> int:
    """Largest reported ``args.inflight``; replayed from the op order where none is reported."""
    events = [e for its_events in grouped.compute.values() for e in its_events if int(e["args"]["stage"]) == stage]
    reported = [int(e["args"]["inflight"]) for e in events if "inflight" in e["args"]]
    if reported:
        return max(reported)
    return max(_replayed_peak(e for e in events if e["pid"] == pid and e["args"]["iteration"] == it)
               for pid in grouped.pids_of_stage[stage] for it in grouped.compute)


def _gpu_mean(grouped: _Grouped, stage: int, its: list[int], value) -> float | None:
    """Mean over iterations of ``value(busy_us per rank, gpu window_us)`` in ms; None without gpu spans."""
    its = [it for it in its if it in grouped.gpu_window]
    if not its:
        return None
    ranks = len(grouped.pids_of_stage[stage])
    return statistics.fmean(value(grouped.gpu_us[(stage, it)] / ranks,
                                  grouped.gpu_window[it][1] - grouped.gpu_window[it][0]) for it in its) / US_PER_MS


def summarize(merged: dict[str, Any], iteration: int | None = None) -> TraceSummary:
    """Summary of all iterations in ``merged``, or of ``iteration`` alone; ValueError if absent."""
    traced = iterations_of(merged)
    if not traced:
        raise ValueError("the trace has no compute (F/B/I/W) events to summarise")
    if iteration is not None and iteration not in traced:
        raise ValueError(f"--iteration {iteration} is not in the trace (traced: {traced})")
    grouped = _group(merged, set(traced if iteration is None else [iteration]))
    its, stages = sorted(grouped.compute), grouped.stages
    step_us = {it: max(e["ts"] + e["dur"] for e in grouped.compute[it]) - min(e["ts"] for e in grouped.compute[it])
               for it in its}
    busy_us = _busy_us(grouped)

    def bubble(stage: int, it: int) -> float:
        return 1.0 - busy_us[(stage, it)] / step_us[it] if step_us[it] > 0 else 0.0

    summaries = [StageSummary(
        stage=stage, ranks=sorted(grouped.ranks_of_stage[stage]),
        busy_ms=statistics.fmean(busy_us[(stage, it)] for it in its) / US_PER_MS,
        idle_ms=statistics.fmean(step_us[it] - busy_us[(stage, it)] for it in its) / US_PER_MS,
        bubble_fraction=statistics.fmean(bubble(stage, it) for it in its),
        wait_ms=statistics.fmean(grouped.wait_us[(stage, it)] for it in its)
        / len(grouped.pids_of_stage[stage]) / US_PER_MS,
        peak_inflight=_peak_inflight(grouped, stage),
        gpu_busy_ms=_gpu_mean(grouped, stage, its, lambda busy, _: busy),
        gpu_idle_ms=_gpu_mean(grouped, stage, its, lambda busy, window: window - busy),
    ) for stage in stages]
    def stage_busy(it: int) -> list[float]:
        if it in grouped.gpu_window:
            return [grouped.gpu_us[(stage, it)] / len(grouped.pids_of_stage[stage]) / US_PER_MS for stage in stages]
        return [busy_us[(stage, it)] / US_PER_MS for stage in stages]

    meta = merged.get("metadata") or {}
    return TraceSummary(
        schedule=str(meta.get("schedule", "?")), source=str(meta.get("source", "?")),
        pipeline_parallel=int(meta.get("pipeline_parallel", len(stages))),
        num_microbatches=int(meta.get("num_microbatches", 0)), num_chunks=int(meta.get("num_chunks", 1)),
        iterations=its,
        iteration_time_ms={it: step_us[it] / US_PER_MS for it in its},
        bubble_fraction_by_iteration={it: statistics.fmean(bubble(s, it) for s in stages) for it in its},
        stages=summaries, missing_ranks=list(meta.get("missing_ranks", [])),
        median_op_ms=_median_op_ms(e for events in grouped.compute.values() for e in events),
        stage_busy_ms={it: stage_busy(it) for it in its},
        layers_per_stage=[layer_count(n) for n in meta.get("layers_per_stage") or []],
    )


def format_table(summary: TraceSummary) -> str:
    """The table the aggregation CLI prints."""
    times = list(summary.iteration_time_ms.values())
    its = summary.iterations
    gpu = all(s.gpu_busy_ms is not None for s in summary.stages)
    lines = [
        f"schedule {summary.schedule} ({summary.source}): PP={summary.pipeline_parallel} "
        f"M={summary.num_microbatches} v={summary.num_chunks}; iterations {its[0]}..{its[-1]} ({len(its)})",
        f"iteration time: mean {summary.mean_iteration_time_ms:.2f} ms (min {min(times):.2f}, max {max(times):.2f})",
        f"bubble fraction: {summary.bubble_fraction:.4f} (1F1B theory (p-1)/(m+p-1) = "
        f"{summary.theoretical_1f1b_bubble:.4f})",
        "median op time: " + ", ".join(f"{cat} {ms:.2f} ms" for cat, ms in summary.median_op_ms.items()),
        "",
        f"{'stage':>5} {'ranks':>10} {'busy ms':>10} {'idle ms':>10} {'bubble':>7} {'wait ms':>9} {'peak inflight':>13}"
        + (f" {'GPU busy ms':>11} {'GPU idle ms':>11}" if gpu else ""),
    ]
    for s in summary.stages:
        ranks = ",".join(map(str, s.ranks)) if s.ranks else "sim"
        line = (f"{s.stage:>5} {ranks:>10} {s.busy_ms:>10.2f} {s.idle_ms:>10.2f} {s.bubble_fraction:>7.4f} "
                f"{s.wait_ms:>9.2f} {s.peak_inflight:>13d}")
        if gpu:
            line += f" {s.gpu_busy_ms:>11.2f} {s.gpu_idle_ms:>11.2f}"
        lines.append(line)
    if summary.missing_ranks:
        lines.append(f"missing ranks (no trace): {', '.join(map(str, summary.missing_ranks))}")
    return "\n".join(lines)
