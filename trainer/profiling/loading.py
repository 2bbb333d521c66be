"""Reading the per-rank trace files of one run, reporting every unreadable or missing one by name.

A run that crashed, was cancelled or ran out of disk leaves some ranks without a file or with half
a file; the aggregation job still merges what is there (it is what a user debugging that run needs
most) and says exactly which ranks are absent and why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.profiling.tracer import trace_file_name

RANK_FILE_PATTERN = re.compile(r"^trace_rank(\d+)\.json$")
"""Per-rank file names as the tracer writes them (leftover ``.tmp`` files never match)."""

LOADER_METADATA = ("stage", "world_size")
"""Metadata keys without which a rank file cannot be placed on the timeline."""


@dataclass
class RankTrace:
    """One rank's (or, from the simulator, every stage's) events and metadata as read from disk."""

    path: Path
    """Where it was read from (named in every problem report)."""
    events: list[dict[str, Any]]
    """The ``traceEvents`` list, untouched."""
    metadata: dict[str, Any]
    """The ``metadata`` object, untouched."""

    @property
    def rank(self) -> int:
        return int(self.metadata.get("rank", -1))

    @property
    def clock_offset_us(self) -> float:
        return float(self.metadata.get("clock_offset_us", 0.0))


@dataclass
class LoadedRun:
    """What :func:`load_rank_traces` found in a benchmark folder."""

    traces: list[RankTrace] = field(default_factory=list)
    """Readable rank traces, in rank order."""
    problems: list[str] = field(default_factory=list)
    """One line per missing, truncated or malformed file, naming the file."""
    missing_ranks: list[int] = field(default_factory=list)
    """Ranks below ``world_size`` with no readable file."""
    world_size: int = 0
    """Largest ``world_size`` any readable file's metadata gives (0 when none is readable)."""


def read_trace_file(path: Path) -> RankTrace:
    """Parses one trace file; ValueError names the file and what is wrong with it."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"{path.name}: unreadable ({err.strerror})") from err
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path.name}: truncated or corrupt JSON ({len(text)} bytes; {err.msg} at "
                         f"char {err.pos})") from err
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ValueError(f"{path.name}: not a trace (no 'traceEvents' list)")
    metadata = document.get("metadata")
    if not isinstance(metadata, dict):
        raise ValueError(f"{path.name}: no 'metadata' object")
    missing = [key for key in LOADER_METADATA if key not in metadata]
    if missing and metadata.get("source") != "simulator":
        raise ValueError(f"{path.name}: metadata lacks {', '.join(missing)}")
    return RankTrace(path=path, events=document["traceEvents"], metadata=metadata)


def load_rank_traces(benchmark_dir: str | Path) -> LoadedRun:
    """Reads every ``trace_rank*.json`` in ``benchmark_dir``; problems are collected, not raised."""
    folder = Path(benchmark_dir)
    if not folder.is_dir():
        raise ValueError(f"--benchmark_dir {folder} is not a directory")
    run = LoadedRun()
    reported: set[int] = set()  # ranks whose file exists but was rejected (already explained)
    for path in sorted(folder.iterdir()):
        match = RANK_FILE_PATTERN.match(path.name)
        if not match:
            continue
        try:
            trace = read_trace_file(path)
        except ValueError as err:
            run.problems.append(str(err))
            reported.add(int(match.group(1)))
            continue
        if trace.rank != int(match.group(1)):
            run.problems.append(f"{path.name}: metadata says rank {trace.rank}; file skipped")
            reported.add(int(match.group(1)))
            continue
        run.traces.append(trace)
    run.world_size = max((int(t.metadata["world_size"]) for t in run.traces), default=0)
    present = {t.rank for t in run.traces}
    run.missing_ranks = [r for r in range(run.world_size) if r not in present]
    for rank in run.missing_ranks:
        if rank not in reported:
            run.problems.append(f"{trace_file_name(rank)}: missing (rank {rank} of world_size "
                                f"{run.world_size} wrote no trace)")
    return run
