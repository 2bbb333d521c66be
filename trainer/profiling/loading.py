"""Reading the per-rank trace files of one run, reporting every unreadable or missing one by name.

A run that crashed, was cancelled or ran out of disk leaves some ranks without a file or with half
a file; the aggregation job still merges what is there (it is what a user debugging that run needs
most) and says exactly which ranks are absent and why.

A run that Slurm requeued ran in segments, each writing its own files: the first into the profile
directory, segment N into its ``segment<N>/`` sub-folder (trainer.profiling.tracer.segment_folder).
All of them are read, as one run: every trace knows its segment.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.profiling.tracer import SEGMENT_DIR_FORMAT, trace_file_name

RANK_FILE_PATTERN = re.compile(r"^trace_rank(\d+)\.json$")
"""Per-rank file names as the tracer writes them (leftover ``.tmp`` files never match)."""
SEGMENT_DIR_PATTERN = re.compile("^" + SEGMENT_DIR_FORMAT.format(segment=r"([1-9]\d*)") + "$")
"""Sub-folders of a requeued run's later segments (``segment1``, ``segment2``, ...)."""

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
    segment: int = 0
    """The run's segment it belongs to (0: the first run, or a run never requeued); from its folder."""

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
    """Reads every ``trace_rank*.json`` in ``benchmark_dir`` and in its ``segment<N>/`` sub-folders
    (a requeued run's later segments); problems are collected, not raised."""
    folder = Path(benchmark_dir)
    if not folder.is_dir():
        raise ValueError(f"--benchmark_dir {folder} is not a directory")
    run = LoadedRun()
    segments = [(0, folder)] + sorted(
        (int(match.group(1)), path) for path in folder.iterdir()
        if path.is_dir() and (match := SEGMENT_DIR_PATTERN.match(path.name)))
    missing: set[int] = set()
    for segment, where in segments:
        prefix = "" if segment == 0 else f"{where.name}/"
        traces = _load_one_folder(where, segment, prefix, run.problems)
        if not traces and segment == 0 and len(segments) > 1:
            run.problems.append(f"no trace_rank*.json of the run's first segment in {folder} (only of its "
                                "later segments: " + ", ".join(w.name for _, w in segments[1:]) + ")")
        run.traces.extend(traces)
        world_size = max((int(t.metadata["world_size"]) for t in traces), default=0)
        run.world_size = max(run.world_size, world_size)
        present = {t.rank for t in traces}
        reported = {r for r in range(world_size) if any(p.startswith(f"{prefix}{trace_file_name(r)}:")
                                                        for p in run.problems)}
        for rank in range(world_size):
            if rank in present:
                continue
            missing.add(rank)
            if rank not in reported:
                run.problems.append(f"{prefix}{trace_file_name(rank)}: missing (rank {rank} of world_size "
                                    f"{world_size} wrote no trace)")
    run.missing_ranks = sorted(missing)
    return run


def _load_one_folder(folder: Path, segment: int, prefix: str, problems: list[str]) -> list[RankTrace]:
    traces = []
    for path in sorted(folder.iterdir()):
        match = RANK_FILE_PATTERN.match(path.name)
        if not match:
            continue
        try:
            trace = read_trace_file(path)
        except ValueError as err:
            problems.append(f"{prefix}{err}")
            continue
        if trace.rank != int(match.group(1)):
            problems.append(f"{prefix}{path.name}: metadata says rank {trace.rank}; file skipped")
            continue
        trace.segment = segment
        traces.append(trace)
    return traces
