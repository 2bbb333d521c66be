"""Chrome-trace export of a simulated step, in the format the runtime tracer writes (docs/profiling.md#trace-format-contract-shared-by-the-runtime-the-simulator-and-the-aggregator).

One file holds every stage (``pid`` = stage, ``metadata.source = "simulator"``, ``rank = -1``), so
the profiling aggregator, Perfetto and chrome://tracing read simulated and measured steps alike.
Simulated times are in cost units; one unit is written as one millisecond (``ts`` in µs).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.schedule.core import Op
from trainer.schedule.simulator import OpRecord, SimResult

US_PER_UNIT = 1000.0
"""Microseconds written per simulated cost unit (1 unit = 1 ms)."""


def _event(name: str, cat: str, tid: str, start: float, end: float, stage: int, **args: Any) -> dict:
    return {
        "name": name, "ph": "X", "ts": start * US_PER_UNIT, "dur": max(end - start, 0.0) * US_PER_UNIT,
        "pid": stage, "tid": tid, "cat": cat, "args": {"iteration": 0, "stage": stage, **args},
    }


def trace_events(result: SimResult, transfer: float | Sequence[float] | None = None) -> list[dict]:
    """Compute, send and wait events of every stage of ``result`` (which must have a timeline).
    ``transfer``: one time for every edge or one per edge; None: what the run used."""
    if result.timeline is None:
        raise ValueError("the simulation was run without record=True: it has no timeline to export")
    shape = result.shape
    if transfer is None:
        transfer = result.edge_transfer or 0.0
    edges = [float(transfer)] * shape.num_stages if isinstance(transfer, int | float) else list(transfer)
    events: list[dict] = []
    last_end = [0.0] * shape.num_stages
    for record in sorted(result.timeline, key=lambda r: (r.stage, r.start)):
        s, action = record.stage, record.action
        if record.start > last_end[s]:
            events.append(_event("wait", "wait", "wait", last_end[s], record.start, s))
        last_end[s] = record.end
        m, c = action.microbatch, action.chunk
        events.append(_event(str(action), action.op.value, "compute", record.start, record.end, s,
                             microbatch=m, chunk=c, inflight=record.inflight))
        events.extend(_send_event(shape, record, edges))
    return events


def _send_event(shape, record: OpRecord, edges: list[float]) -> list[dict]:
    action, s = record.action, record.stage
    m, c = action.microbatch, action.chunk
    if action.op is Op.F and shape.downstream(s, c) is not None:
        kind, transfer = "act", edges[s]
    elif action.op in (Op.B, Op.I) and shape.upstream(s, c) is not None:
        kind, transfer = "grad", edges[shape.upstream(s, c)[0]]
    else:
        return []
    return [_event(f"send {kind} m{m}.c{c}", "send", "comm", record.end, record.end + transfer, s,
                   microbatch=m, chunk=c)]


def trace_document(result: SimResult, transfer: float | Sequence[float] | None = None) -> dict:
    shape = result.shape
    return {
        "traceEvents": trace_events(result, transfer),
        "metadata": {
            "rank": -1, "stage": -1, "tp_rank": 0, "dp_rank": 0,
            "world_size": shape.num_stages, "pipeline_parallel": shape.num_stages,
            "num_chunks": shape.num_chunks, "num_microbatches": shape.num_microbatches,
            "schedule": result.schedule, "source": "simulator", "clock_offset_us": 0.0,
        },
    }


def write_trace(path: str | os.PathLike, result: SimResult,
                transfer: float | Sequence[float] | None = None) -> Path:
    """Write ``result``'s trace to ``path`` atomically (temporary file, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    document = trace_document(result, transfer)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
