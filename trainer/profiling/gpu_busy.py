"""GPU busy time measured on the GPU: kernel intervals from torch.profiler (CUPTI), not host spans.

Host spans around an F or B say when the host *queued* kernels, which on CUDA can be long before
or after they ran; a pipeline's real bubbles are where the GPU has nothing to run. So for a window
of iterations this records every kernel (CUDA activity only: no CPU op tracing, which would slow
the host) and reports, per iteration:

* ``compute_ms``: length of the union of the non-communication kernels (NCCL kernels spin while
  they wait for a peer, so counting them would call waiting "busy"). The injected stall kernel
  (``--inject-stalls``) counts as busy: it stands for a slow kernel.
* ``nccl_ms``: union of the NCCL kernels, for reference.

and, over the whole window, a table of kernel time by kernel name (``by_kernel``: summed durations per
iteration, not a union, with the calls per iteration; the names that take the most time, the rest as one
row): where two schedules' busy times differ, which kernels differ (trainer/bench/kernel_diff.py).

Kineto reports kernel times on the host's wall clock (ns since the epoch, the clock
``time.time_ns`` and our tracer read), so kernels fall into iterations by the host time at which
each step ended (after its loss all-reduce, which waits for the GPU), and the kernel intervals of
ranks on one host share a time axis: the benchmark draws them as one GPU timeline per schedule,
megatron-core's own schedules included (our tracer only sees our runtime).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

DRAW_GAP_US = 20.0
"""Kernel gaps shorter than this are closed in the intervals kept for drawing (not in the totals)."""

KERNEL_ROWS = 40
"""How many kernel names the per-name table keeps (by time); the rest are summed into :data:`OTHER`."""

OTHER = "(other kernels)"


def union_us(intervals: list[tuple[float, float]], gap_us: float = 0.0) -> list[tuple[float, float]]:
    """Merge (start, end) intervals; gaps up to ``gap_us`` are closed."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + gap_us:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _total(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def is_communication_kernel(name: str) -> bool:
    return name.lower().startswith("nccl")


@dataclass
class GpuBusyMeter:
    """Profiles iterations ``first..last`` (0-based step indices) of this rank's run on CUDA."""

    first: int
    last: int
    _profiler: Any = None
    _boundaries_us: list[tuple[int, float, float]] = field(default_factory=list)
    """(iteration, host start µs, host end µs) of each profiled step."""
    _step_start_us: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last

    def before_step(self, step: int) -> None:
        if not self.covers(step):
            return
        if self._profiler is None:
            import torch
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self._profiler = profile(activities=[ProfilerActivity.CUDA])
            self._profiler.__enter__()
        self._step_start_us = time.time_ns() / 1000.0

    def after_step(self, step: int) -> None:
        if not self.covers(step) or self._profiler is None:
            return
        import torch

        torch.cuda.synchronize()
        self._boundaries_us.append((step, self._step_start_us, time.time_ns() / 1000.0))
        if step == self.last:
            self._finish()

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        kernels = [(e.name(), e.start_ns() / 1000.0, (e.start_ns() + e.duration_ns()) / 1000.0)
                   for e in profiler.profiler.kineto_results.events() if "cuda" in str(e.device_type()).lower()]
        self.result = summarize_kernels(kernels, self._boundaries_us)


def summarize_kernels(kernels: list[tuple[str, float, float]],
                      boundaries_us: list[tuple[int, float, float]]) -> dict[str, Any]:
    """Per-iteration compute/NCCL kernel unions; intervals of the last iteration kept for drawing."""
    per_iteration = []
    drawn: dict[str, Any] = {}
    for iteration, start, end in boundaries_us:
        inside = [(n, max(a, start), min(b, end)) for n, a, b in kernels if b > start and a < end]
        compute = union_us([(a, b) for n, a, b in inside if not is_communication_kernel(n)])
        nccl = union_us([(a, b) for n, a, b in inside if is_communication_kernel(n)])
        per_iteration.append({"iteration": iteration + 1, "compute_ms": _total(compute) / 1000.0,
                              "nccl_ms": _total(nccl) / 1000.0, "kernels": len(inside),
                              "step_ms": (end - start) / 1000.0})
        drawn = {"iteration": iteration + 1, "step_start_us": start, "step_end_us": end,
                 "compute": union_us(compute, DRAW_GAP_US), "nccl": union_us(nccl, DRAW_GAP_US)}
    if kernels and not any(it["kernels"] for it in per_iteration):
        by_kernel = kernel_table(kernels, [(min(a for _, a, _ in kernels), max(b for _, _, b in kernels))],
                                 len(per_iteration) or 1)
        # Kernel times not on the host's wall clock after all (a torch/kineto change): say so and
        # spread the window's kernel time evenly rather than report an idle GPU.
        compute = _total(union_us([(a, b) for n, a, b in kernels if not is_communication_kernel(n)]))
        share = len(per_iteration) or 1
        for it in per_iteration:
            it.update(compute_ms=compute / share / 1000.0, kernels=len(kernels) // share)
        return {"source": "torch.profiler CUDA kernels (clock mismatch: window average)",
                "iterations": per_iteration, "timeline": {}, "by_kernel": by_kernel}
    windows = [(start, end) for _, start, end in boundaries_us]
    return {"source": "torch.profiler CUDA kernels", "iterations": per_iteration, "timeline": drawn,
            "by_kernel": kernel_table(kernels, windows, len(windows) or 1)}


def kernel_table(kernels: list[tuple[str, float, float]], windows: list[tuple[float, float]],
                 iterations: int, rows: int = KERNEL_ROWS) -> list[dict[str, Any]]:
    """Per kernel name, the time (ms) and calls per iteration inside ``windows`` (each kernel clipped to
    its window), the longest ``rows`` names first, then one :data:`OTHER` row for the rest. NCCL kernels
    are listed like any other (their time is mostly waiting; the busy figures leave them out)."""
    totals: dict[str, list[float]] = {}
    for name, a, b in kernels:
        for start, end in windows:
            if b > start and a < end:
                row = totals.setdefault(name, [0.0, 0])
                row[0] += min(b, end) - max(a, start)
                row[1] += 1
    ranked = sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))
    table = [{"name": name, "ms": us / 1000.0 / iterations, "calls": calls / iterations}
             for name, (us, calls) in ranked[:rows]]
    rest = ranked[rows:]
    if rest:
        table.append({"name": OTHER, "ms": sum(us for _, (us, _) in rest) / 1000.0 / iterations,
                      "calls": sum(calls for _, (_, calls) in rest) / iterations})
    return table
