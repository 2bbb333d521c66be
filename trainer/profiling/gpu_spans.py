"""GPU time of each pipeline op, measured with CUDA events, as "gpu" spans in the rank's trace.

Host spans show when the host *enqueued* an op, not when the GPU ran it: a host that runs ahead makes
F/B spans short while the GPU is busy, and a GPU waiting on the host shows no gap in them at all. So
with ``--profile-dir`` on CUDA the DPP runtime also records a pair of timing events around every op
on the compute stream. At the end of the step (tracing only) one synchronize resolves them, and each
op becomes a span ``cat="gpu"``, ``tid="gpu"`` named like its host span (``F3.c0``), placed on the
host clock through a reference event recorded right after a synchronize at step start. The gaps
between a stage's gpu spans are its GPU idle time (waiting for inputs, or for the host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from trainer.profiling.tracer import now_us


class GpuOpTimer:
    """One per rank; ``begin_step`` / ``around(op)`` for each op / ``end_step(tracer)``."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._ops: list[tuple[str, torch.cuda.Event, torch.cuda.Event, dict[str, Any]]] = []
        self._ref: torch.cuda.Event | None = None
        self._ref_host_us = 0.0

    def begin_step(self) -> None:
        # The reference event's GPU time equals its host time only if the GPU is idle when it is
        # recorded: the one synchronize profiling pays per step.
        torch.cuda.synchronize(self._device)
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(torch.cuda.current_stream(self._device))
        self._ref_host_us = now_us()
        self._ops.clear()

    @contextlib.contextmanager
    def around(self, name: str, **args: Any) -> Iterator[None]:
        stream = torch.cuda.current_stream(self._device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self._ops.append((name, start, end, args))

    def end_step(self, tracer: Any) -> None:
        """Resolve this step's events (one synchronize) and record them as gpu spans."""
        if self._ref is None or not self._ops:
            return
        self._ops[-1][2].synchronize()  # same stream: every earlier event is complete too
        for name, start, end, args in self._ops:
            s = self._ref_host_us + 1000.0 * self._ref.elapsed_time(start)
            e = self._ref_host_us + 1000.0 * self._ref.elapsed_time(end)
            tracer.record(name, "gpu", s, e, tid="gpu", **args)
        self._ops.clear()
        self._ref = None
