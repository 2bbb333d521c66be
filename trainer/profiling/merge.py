"""Merging rank traces into one Chrome/Perfetto trace on rank 0's clock.

What the merge does, and why:

* Timestamps: each rank's ``ts`` plus its ``clock_offset_us`` is rank 0's clock; the merged trace
  then subtracts the earliest aligned timestamp, so it starts at 0 and stays readable (the
  original origin is kept in ``metadata.time_origin_us``).
* ``pid``: one track group per pipeline stage. With one rank per stage pid = stage; with several
  (data or tensor parallel replicas) pid = stage * ranks_per_stage + index, so replicas stay apart
  but sort by stage. ``process_name`` metadata events read "stage s (rank r)".
* ``tid``: 0 compute, 1 comm, 2 wait, named by ``thread_name`` metadata events; integer pids and
  tids are what every Chrome trace viewer accepts.
* The simulator's single file (all stages, ``rank`` -1) goes through the same code, so a
  simulated and a measured schedule come out in the same shape.
* Segments of a requeued run (trainer.profiling.loading) merge as one run: each segment must be
  one run of its own (its ``run_id``), events carry ``args.segment`` and ``metadata.segments`` lists
  each segment's run, ranks and iterations. An iteration computed by two segments (the resumed run
  repeats those after its checkpoint) is the later segment's: the earlier one's events of it are
  dropped and listed as ``superseded_iterations``, since only the repeated one counted in training;
  so are a segment's start-up events tagged with an iteration another segment computed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from trainer.profiling.loading import RankTrace
from trainer.profiling.tracer import THREADS

THREAD_IDS = MappingProxyType({name: index for index, name in enumerate(THREADS)})
"""Merged ``tid`` of each per-rank thread name."""

RUN_METADATA = ("schedule", "pipeline_parallel", "num_chunks", "num_microbatches", "world_size", "source", "run_id",
                "layers_per_stage")
"""Run-wide metadata copied from the rank files into the merged trace."""


def _event_stage(event: dict[str, Any], trace: RankTrace) -> int:
    """The event's stage: its ``args.stage``, else the file's stage, else (simulator) its pid."""
    args = event.get("args") or {}
    if "stage" in args:
        return int(args["stage"])
    if "stage" in trace.metadata and trace.metadata.get("source") != "simulator":
        return int(trace.metadata["stage"])
    return int(event["pid"])


def _process_ids(keys: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """pid of every (stage, rank): the stage itself with one rank per stage, else stage-major."""
    by_stage: dict[int, list[int]] = defaultdict(list)
    for stage, rank in sorted(keys):
        by_stage[stage].append(rank)
    per_stage = max((len(ranks) for ranks in by_stage.values()), default=1)
    return {(stage, rank): stage * per_stage + index
            for stage, ranks in by_stage.items() for index, rank in enumerate(ranks)}


def _process_label(stage: int, rank: int) -> str:
    return f"stage {stage} (simulated)" if rank < 0 else f"stage {stage} (rank {rank})"


def _run_metadata(traces: Sequence[RankTrace]) -> dict[str, Any]:
    """Run-wide metadata: first file's values (every rank of one run writes the same ones)."""
    merged: dict[str, Any] = {}
    for key in RUN_METADATA:
        for trace in traces:
            if key in trace.metadata:
                merged[key] = trace.metadata[key]
                break
    return merged


def check_one_run(traces: Sequence[RankTrace]) -> None:
    """ValueError naming every run and its files when the traces of one segment do not all carry one
    ``run_id``.

    Ranks of two runs in one folder (a reused --profile-dir, a copy into the wrong place) would
    otherwise merge into one timeline whose clocks and iterations belong to different runs: the
    summary then comes out with iteration times 100x off and nothing says why. A file without a
    ``run_id`` (written before traces carried one) counts as a run of its own. The segments of a
    requeued run are runs of their own by design (each requeue starts a new run).
    """
    by_segment: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for trace in traces:
        by_segment[trace.segment][str(trace.metadata.get("run_id", "<none>"))].append(trace.path.name)
    for segment, by_run in sorted(by_segment.items()):
        if len(by_run) > 1:
            runs = "; ".join(f"run {run_id}: {', '.join(sorted(names))}" for run_id, names in sorted(by_run.items()))
            where = f" of segment {segment}" if len(by_segment) > 1 else ""
            raise ValueError(f"the traces{where} come from {len(by_run)} different runs ({runs}); "
                             "aggregate one run's folder (each run writes its own, runs/<run>/traces)")


COMPUTE_CATEGORIES = frozenset({"F", "B", "I", "W"})


def _iteration(event: dict[str, Any]) -> int:
    return int((event.get("args") or {}).get("iteration", -1))


def _owners(traces: Sequence[RankTrace]) -> dict[int, int]:
    """Iteration -> the segment whose events of it are kept: the latest one that computed it.

    A resumed segment repeats the iterations after the checkpoint it resumed from, and only its
    run of them counted in training; a segment's events of an iteration it did not compute (the
    garbage collections of its start-up, recorded before its first step) belong to no iteration."""
    owners: dict[int, int] = {}
    for trace in traces:
        for event in trace.events:
            if event.get("cat") in COMPUTE_CATEGORIES:
                it = _iteration(event)
                owners[it] = max(owners.get(it, trace.segment), trace.segment)
    return owners


def _segments_metadata(traces: Sequence[RankTrace], owners: dict[int, int]) -> list[dict[str, Any]]:
    rows = []
    for segment in sorted({t.segment for t in traces}):
        mine = [t for t in traces if t.segment == segment]
        computed = {_iteration(e) for t in mine for e in t.events if e.get("cat") in COMPUTE_CATEGORIES}
        rows.append({"segment": segment, "run_id": mine[0].metadata.get("run_id"),
                     "ranks": sorted(t.rank for t in mine),
                     "iterations": sorted(it for it in computed if owners.get(it) == segment),
                     "superseded_iterations": sorted(it for it in computed if owners.get(it) != segment)})
    return rows


def merge_traces(traces: Sequence[RankTrace], missing_ranks: Sequence[int] = (),
                 problems: Sequence[str] = ()) -> dict[str, Any]:
    """One Chrome trace document (``traceEvents`` + ``metadata``) from the given rank traces of one
    run (of its segments, when requeued); ValueError (see :func:`check_one_run`) when they come from
    several."""
    if not traces:
        raise ValueError("merge_traces needs at least one readable trace, got none")
    check_one_run(traces)
    segmented = len({t.segment for t in traces}) > 1
    owners = _owners(traces) if segmented else {}
    placed: list[tuple[int, int, float, dict[str, Any]]] = []  # (stage, rank, aligned ts, event)
    for trace in traces:
        for event in trace.events:
            if event.get("ph") != "X":
                continue  # per-rank files hold complete events only; anything else is not ours
            if owners.get(_iteration(event), trace.segment) != trace.segment:
                continue  # another segment's iteration (see _owners)
            if segmented:
                event = dict(event, args=dict(event.get("args") or {}, segment=trace.segment))
            stage = _event_stage(event, trace)
            placed.append((stage, trace.rank, float(event["ts"]) + trace.clock_offset_us, event))
    origin = min((ts for _, _, ts, _ in placed), default=0.0)
    pids = _process_ids({(stage, rank) for stage, rank, _, _ in placed} |
                        {(int(t.metadata["stage"]), t.rank) for t in traces if t.rank >= 0})

    events: list[dict[str, Any]] = []
    for (stage, rank), pid in sorted(pids.items(), key=lambda item: item[1]):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": _process_label(stage, rank)}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for thread, tid in THREAD_IDS.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": thread}})
    for stage, rank, ts, event in sorted(placed, key=lambda item: item[2]):
        args = dict(event.get("args") or {}, stage=stage)
        if rank >= 0:
            args["rank"] = rank
        events.append({
            "name": event.get("name"), "ph": "X", "ts": ts - origin, "dur": event.get("dur"),
            "pid": pids[(stage, rank)], "tid": THREAD_IDS.get(event.get("tid"), event.get("tid")),
            "cat": event.get("cat"), "args": args,
        })

    metadata = _run_metadata(traces)
    metadata.update(
        time_origin_us=origin,
        ranks=sorted(t.rank for t in traces if t.rank >= 0),
        missing_ranks=list(missing_ranks),
        clock_offsets_us={str(t.rank): t.clock_offset_us for t in traces if t.rank >= 0},
        problems=list(problems),
        dropped_iterations=max(int(t.metadata.get("dropped_iterations", 0)) for t in traces),
    )
    if segmented:
        metadata["segments"] = _segments_metadata(traces, owners)
        metadata["run_id"] = traces[-1].metadata.get("run_id")  # the last segment's: the one that finished
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}
