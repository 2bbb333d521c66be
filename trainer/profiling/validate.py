"""Checks a merged trace against the Chrome trace event format and against the pipeline's bookkeeping.

Format: every complete event (``ph: "X"``) has name, ph, ts, dur, pid, tid, cat and args; ``ts``
and ``dur`` are finite µs numbers, ``ts`` >= 0 (merged traces start at 0), ``dur`` >= 0.

Slices on one thread (pid, tid) nest or follow each other, never partially overlap.

Bookkeeping: on every pipeline rank (merged ``pid``), in every iteration it traced, each forward
and each backward (``B``, or ``I`` and ``W`` when the backward is split) of every microbatch and
chunk ran exactly once, and each compute event's name is its action (``F3.c0``).

Returns a list of human-readable problems; an empty list means the trace is valid.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any

from trainer.profiling.tracer import CATEGORIES

REQUIRED_KEYS = ("name", "ph", "ts", "dur", "pid", "tid", "cat", "args")
COMPUTE_CATEGORIES = ("F", "B", "I", "W")
MAX_LISTED = 8
"""Problems of one kind listed individually before the rest are counted (keeps reports short)."""
NEST_SLACK_US = 0.5
"""Rounding allowance when comparing slice ends: float64 µs since 1970 has 0.25 µs steps."""
SECONDS_SUSPECT_US = 1.0
"""A median compute duration below 1 µs means timestamps were written in seconds, not µs."""


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _event_problems(index: int, event: Any) -> list[str]:
    if not isinstance(event, dict):
        return [f"event {index}: not an object"]
    if event.get("ph") == "M":
        return [] if "name" in event and "pid" in event else [f"event {index}: metadata event without name/pid"]
    where = f"event {index} ({event.get('name')!r})"
    missing = [key for key in REQUIRED_KEYS if key not in event]
    if missing:
        return [f"{where}: missing {', '.join(missing)}"]
    problems = []
    if event["ph"] != "X":
        problems.append(f"{where}: ph={event['ph']!r}, expected 'X' (complete event)")
    if not _is_number(event["ts"]) or event["ts"] < 0:
        problems.append(f"{where}: ts={event['ts']!r} is not a finite µs timestamp >= 0")
    if not _is_number(event["dur"]) or event["dur"] < 0:
        problems.append(f"{where}: dur={event['dur']!r} is not a finite duration >= 0")
    if event["cat"] not in CATEGORIES:
        problems.append(f"{where}: cat={event['cat']!r} not one of {', '.join(CATEGORIES)}")
    if not isinstance(event["args"], dict) or "iteration" not in event["args"]:
        problems.append(f"{where}: args lacks 'iteration'")
    elif event["cat"] in COMPUTE_CATEGORIES:
        args = event["args"]
        if "microbatch" not in args or "chunk" not in args:
            problems.append(f"{where}: compute event args lack microbatch/chunk")
        elif event["name"] != f"{event['cat']}{args['microbatch']}.c{args['chunk']}":
            problems.append(f"{where}: name does not match cat/microbatch/chunk "
                            f"({event['cat']}{args['microbatch']}.c{args['chunk']})")
    return problems


def _schedule_problems(compute: list[dict[str, Any]], metadata: dict[str, Any]) -> list[str]:
    """Every F and B (or I and W) of every (microbatch, chunk) once per pid and iteration."""
    try:
        microbatches = int(metadata["num_microbatches"])
        chunks = int(metadata.get("num_chunks", 1))
        # --rampup-batch-size: iterations of fewer microbatches, as the tracer recorded them.
        by_iteration = {int(k): int(v) for k, v in (metadata.get("microbatches_by_iteration") or {}).items()}
    except (KeyError, TypeError, ValueError):
        return ["metadata lacks num_microbatches: cannot check that every microbatch ran"]
    seen: dict[tuple[Any, int], Counter] = defaultdict(Counter)
    for event in compute:
        args = event["args"]
        seen[(event["pid"], args["iteration"])][(event["cat"], args["microbatch"], args["chunk"])] += 1
    problems = []
    for (pid, iteration), counts in sorted(seen.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        split = any(op in ("I", "W") for op, _, _ in counts)
        ops = ("F", "I", "W") if split else ("F", "B")
        count = by_iteration.get(iteration, microbatches)
        expected = {(op, m, c) for op in ops for m in range(count) for c in range(chunks)}
        missing = sorted(expected - set(counts))
        extra = sorted(key for key in counts if key not in expected)
        repeated = sorted(key for key, n in counts.items() if n > 1 and key in expected)
        where = f"pid {pid} iteration {iteration}"
        for label, keys in (("missing", missing), ("unexpected", extra), ("ran more than once", repeated)):
            if keys:
                names = [f"{op}{m}.c{c}" for op, m, c in keys]
                shown = ", ".join(names[:MAX_LISTED]) + (f" (+{len(names) - MAX_LISTED} more)"
                                                         if len(names) > MAX_LISTED else "")
                problems.append(f"{where}: {label}: {shown}")
    return problems


def _nesting_problems(events: list[dict[str, Any]]) -> list[str]:
    """Slices on one (pid, tid) must nest or follow each other: viewers mis-draw partial overlaps,
    and on a compute thread an overlap means two operations claim the same core at once."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        by_thread[(event["pid"], event["tid"])].append(event)
    problems = []
    for (pid, tid), thread in sorted(by_thread.items(), key=lambda item: str(item[0])):
        open_slices: list[dict[str, Any]] = []  # enclosing slices, innermost last
        for event in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
            end = event["ts"] + event["dur"]
            while open_slices and open_slices[-1]["ts"] + open_slices[-1]["dur"] <= event["ts"] + NEST_SLACK_US:
                open_slices.pop()
            if open_slices and end > open_slices[-1]["ts"] + open_slices[-1]["dur"] + NEST_SLACK_US:
                problems.append(f"pid {pid} tid {tid}: {event['name']} partially overlaps "
                                f"{open_slices[-1]['name']}")
                continue
            open_slices.append(event)
    return problems[:MAX_LISTED]


def validate_trace(merged: dict[str, Any]) -> list[str]:
    """Problems found in a merged trace document (empty list: valid). Never raises on bad input."""
    if not isinstance(merged, dict) or not isinstance(merged.get("traceEvents"), list):
        return ["not a Chrome trace object: no 'traceEvents' list"]
    problems: list[str] = []
    for index, event in enumerate(merged["traceEvents"]):
        problems.extend(_event_problems(index, event))
    if problems:
        return problems[:MAX_LISTED] + ([f"... {len(problems) - MAX_LISTED} more event problems"]
                                        if len(problems) > MAX_LISTED else [])
    compute = [e for e in merged["traceEvents"] if e.get("ph") == "X" and e["cat"] in COMPUTE_CATEGORIES]
    if not compute:
        return ["no compute (F/B/I/W) events"]
    median_us = statistics.median(e["dur"] for e in compute)
    if median_us < SECONDS_SUSPECT_US:
        problems.append(f"median compute duration {median_us:g} µs < {SECONDS_SUSPECT_US:g} µs: "
                        "timestamps look like seconds, not µs")
    problems.extend(_schedule_problems(compute, merged.get("metadata") or {}))
    problems.extend(_nesting_problems([e for e in merged["traceEvents"] if e.get("ph") == "X"]))
    return problems
