"""One benchmark line's figures, read from its ranks' ``metrics_rank<R>.json`` (trainer/measure/run_metrics.py).

* ms/iteration: per iteration the slowest rank's step time, over iterations after ``skip_iters``
  that did not run under the kernel profiler; median, min/max and inter-quartile range.
* tokens/s: tokens per iteration over the median time; where the timed iterations' global batches
  differ (--rampup-batch-size) the median of each iteration's own tokens over its own time.
* GPU busy per stage: mean ``compute_ms`` of the profiled iterations (union of non-NCCL kernels, on
  the GPU). On CPU there is no such thing; the busy time of our runtime's traced F/B spans (host) is
  given instead when the line was traced, and marked so.
* losses: the first 10 iterations as the last stage logged them.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.schedule.stage_parts import layer_count

LOSS_ITERATIONS = 10


@dataclass
class LineResult:
    """What the report prints for one line."""

    key: str
    name: str
    scenario: str
    label: str
    status: str = "ok"
    """"ok", or why there are no figures (not run, failed with exit code and log tail)."""
    timed_ms: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    """With --rounds: this line's median in each round (timed_ms pools every round's iterations)."""
    tokens_per_iteration: int = 0
    """At --global-batch-size (with real tokens counted where the bench's scenario sets it)."""
    timed_batches: list[float] = field(default_factory=list)
    """Per timed iteration (as ``timed_ms``), its global batch as a fraction of --global-batch-size:
    below 1 during a --rampup-batch-size ramp; empty for metrics that do not record it."""
    peak_gib: float | None = None
    """Peak allocated memory, max over ranks (torch.cuda.max_memory_allocated)."""
    reserved_gib: float | None = None
    """Peak reserved memory, max over ranks (max_memory_reserved: cache and CUDA-graph pools included)."""
    busy_ms: dict[int, float] = field(default_factory=dict)
    """Stage -> busy time per iteration."""
    busy_source: str = ""
    busy_rows: list[list[float]] = field(default_factory=list)
    """Per profiled iteration, each stage's GPU busy ms (mean over its ranks): the stage balance's input."""
    losses: list[float] = field(default_factory=list)
    layers_per_stage: list[float] = field(default_factory=list)
    delayed_ops: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """The raw per-rank documents (for the timeline)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.timed_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.timed_ms)

    @property
    def iqr_ms(self) -> tuple[float, float]:
        if len(self.timed_ms) < 2:
            return (self.timed_ms[0], self.timed_ms[0])
        q = statistics.quantiles(self.timed_ms, n=4)
        return (q[0], q[2])

    @property
    def tokens_per_s(self) -> float:
        fractions = self.timed_batches
        if len(fractions) != len(self.timed_ms) or all(f == 1.0 for f in fractions):
            return self.tokens_per_iteration / (self.median_ms / 1e3)
        return statistics.median(self.tokens_per_iteration * f / (ms / 1e3)
                                 for f, ms in zip(fractions, self.timed_ms, strict=True))


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("metrics_rank*.json"))]


def _timed(documents: list[dict[str, Any]], skip_iters: int) -> tuple[list[float], list[float]]:
    """(ms, batch fraction) of each timed iteration; no fractions where a record lacks its batch."""
    per_iteration: dict[int, float] = {}
    fraction: dict[int, float] = {}
    profiled: set[int] = set()
    for doc in documents:
        full = doc.get("tokens_per_iteration")
        for record in doc["iterations"]:
            it = record["iteration"]
            per_iteration[it] = max(per_iteration.get(it, 0.0), record["ms"])
            if record.get("gpu_profiled"):
                profiled.add(it)
            if full and record.get("tokens") is not None:
                fraction[it] = record["tokens"] / full
    timed = [it for it in sorted(per_iteration) if it > skip_iters and it not in profiled]
    fractions = [fraction[it] for it in timed] if all(it in fraction for it in timed) else []
    return [per_iteration[it] for it in timed], fractions


def _gpu_busy(documents: list[dict[str, Any]]) -> dict[int, float]:
    by_stage: dict[int, list[float]] = {}
    for doc in documents:
        busy = doc.get("gpu_busy") or {}
        values = [it["compute_ms"] for it in busy.get("iterations", [])]
        if values:
            by_stage.setdefault(doc["stage"], []).append(statistics.fmean(values))
    return {stage: statistics.fmean(v) for stage, v in sorted(by_stage.items())}


def _gpu_busy_rows(documents: list[dict[str, Any]]) -> list[list[float]]:
    """Per profiled iteration that every stage has, the stages' busy ms (mean over each stage's ranks)."""
    cells: dict[int, dict[int, list[float]]] = {}
    for doc in documents:
        for it in (doc.get("gpu_busy") or {}).get("iterations", []):
            cells.setdefault(it["iteration"], {}).setdefault(doc["stage"], []).append(it["compute_ms"])
    stages = sorted({doc["stage"] for doc in documents})
    return [[statistics.fmean(by_stage[s]) for s in stages] for _, by_stage in sorted(cells.items())
            if sorted(by_stage) == stages]


def _host_busy(trace_dir: Path) -> dict[int, float]:
    """Busy time of the traced F/B/I/W spans of our runtime (host clock), per stage."""
    if not trace_dir.is_dir():
        return {}
    from trainer.profiling.loading import load_rank_traces
    from trainer.profiling.merge import merge_traces
    from trainer.profiling.summary import summarize

    run = load_rank_traces(trace_dir)
    if not run.traces:
        return {}
    summary = summarize(merge_traces(run.traces, run.missing_ranks, run.problems))
    return {s.stage: s.busy_ms for s in summary.stages}


def line_result(key: str, name: str, scenario: str, label: str, folder: Path, skip_iters: int) -> LineResult:
    """Figures of a line that ran (status stays "ok" only when every rank wrote its metrics)."""
    documents = read_metrics(folder)
    result = LineResult(key, name, scenario, label, metrics=documents)
    if not documents:
        result.status = "no metrics written"
        return result
    expected = documents[0]["world_size"]
    if len(documents) != expected:
        result.status = f"only {len(documents)} of {expected} ranks wrote metrics"
    result.timed_ms, result.timed_batches = _timed(documents, skip_iters)
    result.tokens_per_iteration = documents[0]["tokens_per_iteration"]
    peaks = [d["peak_memory_bytes"] for d in documents if d.get("peak_memory_bytes") is not None]
    result.peak_gib = max(peaks) / 2**30 if peaks else None
    reserved = [d["peak_reserved_bytes"] for d in documents if d.get("peak_reserved_bytes") is not None]
    result.reserved_gib = max(reserved) / 2**30 if reserved else None
    result.busy_ms = _gpu_busy(documents)
    result.busy_source = "GPU kernels (torch.profiler)" if result.busy_ms else ""
    result.busy_rows = _gpu_busy_rows(documents)
    if not result.busy_ms:
        result.busy_ms = _host_busy(folder / "traces")
        result.busy_source = "host spans of our runtime (CPU run)" if result.busy_ms else "not measured"
    last = max(documents, key=lambda d: (d["stage"], -d["rank"]))
    result.losses = [r["losses"]["lm loss"] for r in last["iterations"][:LOSS_ITERATIONS] if "lm loss" in r["losses"]]
    result.layers_per_stage = [layer_count(n) for n in last["layers_per_stage"]]
    stalls = [d["stalls"]["delayed_ops"] for d in documents if d.get("stalls")]
    result.delayed_ops = sum(stalls) if stalls else None
    result.versions = documents[0].get("versions", {})
    return result
