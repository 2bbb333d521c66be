"""Per-rank Chrome trace recorder: one ``trace_rank<RANK:05d>.json`` per rank, written at close.

The trace format is a contract shared with the simulator and the aggregator (docs/profiling.md):
every event is a Chrome "complete" event (``ph: "X"``) with a µs ``ts`` on this rank's wall clock
(``time.time_ns() / 1000``, the same clock :func:`trainer.profiling.clock.measure_clock_offset`
reads), a ``dur`` >= 0, ``pid`` = this rank, ``tid`` in ``compute | comm | wait``, ``cat`` the
operation kind and ``args`` holding iteration, microbatch, chunk, stage and in-flight activations.

Why events are tuples in a list until :meth:`Tracer.close`: a span sits around every F/B/I/W and
every send/recv of the pipeline loop, so recording must cost about a microsecond. Appending one
tuple does; building dicts and serialising JSON happen once, off the critical path, at close.
With profiling off, :class:`NullTracer` hands out one shared no-op context manager, so the
runtime pays an attribute lookup and a call, nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.problems import raise_if_any
from trainer.profiling.manual_gc import GcTimer

log = logging.getLogger(__name__)

TRACE_FILE_FORMAT = "trace_rank{rank:05d}.json"
"""Name of one rank's trace file inside the profile directory."""

THREADS = ("compute", "comm", "wait", "gpu", "gc")
"""Allowed ``tid`` values of per-rank events: the aggregator maps them to numbered threads."""

CATEGORIES = ("F", "B", "I", "W", "send", "recv", "wait", "gpu", "decide", "gc")
"""Allowed ``cat`` values: the four compute operations, the two transfer directions, waiting, the
GPU time of an op (trainer.profiling.gpu_spans, CUDA runs), the DPP host's time from one op to
its next decision (run-ahead wait, reading arrived headers, landed looks, the policy; args
``run_ahead_ms`` and ``landed_ms``), and Python's garbage collections (thread ``gc``)."""

DEFAULT_KEEP_ITERATIONS = 20
"""Iterations a tracer keeps (the latest ones): enough to see steady state, bounded memory."""

REQUIRED_METADATA = ("stage", "world_size", "pipeline_parallel", "num_chunks", "num_microbatches", "schedule",
                     "run_id")
"""Metadata keys the runtime must give :func:`make_tracer`; the aggregator relies on each one.
``run_id`` is the run's token (trainer.launch.run_token), the same on every rank of one run and different
for every run: the aggregation refuses a folder whose files disagree on it."""


SEGMENT_DIR_FORMAT = "segment{segment}"
"""Sub-folder of the profile directory holding the traces of a requeued run's later segments: Slurm
requeues a preempted or checkpointed job under the same job id (and so the same --profile-dir), and
each segment's ranks would otherwise overwrite the traces of the ones before. Segment 0 (the first
run, and every run that was never requeued) writes into the profile directory itself."""

RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"
"""Slurm's count of the job's requeues: the segment a rank belongs to."""


def segment_from_env(env: Mapping[str, str] | None = None) -> int:
    """This run's segment: $SLURM_RESTART_COUNT (0 when unset, outside Slurm, or not a count)."""
    text = (os.environ if env is None else env).get(RESTART_COUNT_ENV, "").strip()
    return int(text) if text.isdigit() else 0


def segment_folder(profile_dir: str | os.PathLike[str], segment: int) -> Path:
    """Where segment ``segment``'s trace files go: the profile directory itself for segment 0."""
    return Path(profile_dir) if segment == 0 else Path(profile_dir) / SEGMENT_DIR_FORMAT.format(segment=segment)


_EventTuple = tuple[str, str, str, float, float, int, dict[str, Any]]


def trace_file_name(rank: int) -> str:
    """``trace_rank00007.json`` for rank 7."""
    return TRACE_FILE_FORMAT.format(rank=rank)


def now_us() -> float:
    """This rank's wall clock in µs: the time base of every runtime trace event."""
    return time.time_ns() / 1000.0


class _NullSpan:
    """The context manager :class:`NullTracer` returns for every span (and any "nothing to time"
    span elsewhere, e.g. the DPP runtime without a GPU timer): does nothing at all."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, **args: Any) -> None:
        """Accepts late arguments (e.g. ``inflight`` known only after the op) and drops them."""


NULL_SPAN = _NullSpan()  # immutable and stateless: safe to share between every caller


class NullTracer:
    """Profiling off: same methods as :class:`Tracer`, all no-ops, no allocation per span."""

    enabled = False

    def span(self, name: str, cat: str, tid: str = "compute", **args: Any) -> _NullSpan:
        return NULL_SPAN

    def record(self, name: str, cat: str, start_us: float, end_us: float, tid: str = "compute",
               **args: Any) -> None:
        return None

    def set_iteration(self, iteration: int) -> None:
        return None

    def set_microbatches(self, iteration: int, num_microbatches: int) -> None:
        return None

    def set_clock_offset(self, offset_us: float) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class _Span:
    """Times one block and appends it to its tracer on exit (also when the block raises)."""

    __slots__ = ("_tracer", "_name", "_cat", "_tid", "_args", "_start_us")

    def __init__(self, tracer: Tracer, name: str, cat: str, tid: str, args: dict[str, Any]) -> None:
        self._tracer = tracer
        self._name = name
        self._cat = cat
        self._tid = tid
        self._args = args
        self._start_us = 0.0

    def __enter__(self) -> _Span:
        self._start_us = time.time_ns() / 1000.0
        return self

    def __exit__(self, *exc: object) -> None:
        end_us = time.time_ns() / 1000.0
        tracer = self._tracer
        tracer._current.append(
            (self._name, self._cat, self._tid, self._start_us, end_us, tracer._iteration, self._args)
        )

    def set(self, **args: Any) -> None:
        """Adds arguments known only inside the block, e.g. ``inflight`` after a forward ran."""
        self._args.update(args)


class Tracer:
    """Records this rank's events in memory and writes them as one Chrome trace file.

    Use :func:`make_tracer` rather than constructing one directly.
    """

    enabled = True

    def __init__(self, path: Path, rank: int, metadata: Mapping[str, Any],
                 keep_iterations: int | None = DEFAULT_KEEP_ITERATIONS) -> None:
        self.path = Path(path)
        self.rank = rank
        self.keep_iterations = keep_iterations
        self._metadata = dict(metadata, rank=rank, source="runtime")
        self._metadata.setdefault("tp_rank", 0)
        self._metadata.setdefault("dp_rank", 0)
        self._metadata.setdefault("clock_offset_us", 0.0)
        self._stage = int(self._metadata["stage"])
        self._iteration = 0
        # Per iteration, (name, cat, tid, start_us, end_us, iteration, args) in recording order:
        # converted to dicts only at flush. _current is the list of the iteration being recorded.
        self._current: list[_EventTuple] = []
        self._by_iteration: dict[int, list[_EventTuple]] = {0: self._current}
        self._dropped_iterations = 0
        self._closed = False
        # Python's collector stops the host wherever it runs (an automatic gen-2 pass over a model's
        # objects takes milliseconds): each collection is a "gc" span, so a GPU idle gap it caused
        # is named in the critical path (Megatron-LM's answer is --manual-gc; trainer/profiling/manual_gc.py).
        self._gc_timer = GcTimer(self._record_gc)
        self._gc_timer.install()

    # ---- recording (hot path) ------------------------------------------------------------------
    def span(self, name: str, cat: str, tid: str = "compute", **args: Any) -> _Span:
        """Context manager timing its block as one event; ``args`` go to the event's ``args``."""
        return _Span(self, name, cat, tid, args)

    def record(self, name: str, cat: str, start_us: float, end_us: float, tid: str = "compute",
               **args: Any) -> None:
        """Adds an event timed by the caller (µs on :func:`now_us`'s clock), e.g. an async send."""
        self._current.append((name, cat, tid, start_us, end_us, self._iteration, args))

    def set_iteration(self, iteration: int) -> None:
        """Tags every later event with ``iteration`` (the training step number)."""
        if not self._current:  # e.g. iteration 0 of a resumed run: never recorded, not kept
            self._by_iteration.pop(self._iteration, None)
        self._iteration = int(iteration)
        self._current = self._by_iteration.setdefault(self._iteration, [])
        if self.keep_iterations is not None and len(self._by_iteration) > self.keep_iterations:
            # Bounded memory on long runs: ~250 events a step would otherwise grow without end.
            for old in sorted(self._by_iteration)[:-self.keep_iterations]:
                del self._by_iteration[old]
                self._dropped_iterations += 1

    def set_microbatches(self, iteration: int, num_microbatches: int) -> None:
        """``iteration`` ran ``num_microbatches``, not the metadata's num_microbatches (--rampup-batch-size):
        kept in the metadata's ``microbatches_by_iteration`` so the trace checks expect that many."""
        if num_microbatches != self._metadata["num_microbatches"]:
            self._metadata.setdefault("microbatches_by_iteration", {})[str(int(iteration))] = int(num_microbatches)

    def _record_gc(self, generation: int, start_us: float, end_us: float, collected: int) -> None:
        self.record(f"gc gen{generation}", "gc", start_us, end_us, tid="gc", generation=generation,
                    collected=collected)

    def set_clock_offset(self, offset_us: float) -> None:
        """µs to add to this rank's timestamps to read rank 0's clock (see clock.py)."""
        self._metadata["clock_offset_us"] = float(offset_us)

    @property
    def num_events(self) -> int:
        return sum(len(events) for events in self._by_iteration.values())

    # ---- output --------------------------------------------------------------------------------
    def to_chrome(self) -> dict[str, Any]:
        """The trace as the contract's JSON document (events in recording order)."""
        stage, rank = self._stage, self.rank
        events = []
        recorded = (event for it in sorted(self._by_iteration) for event in self._by_iteration[it])
        for name, cat, tid, start_us, end_us, iteration, args in recorded:
            event_args = {"iteration": iteration, "stage": stage}
            event_args.update(args)
            events.append({
                "name": name, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
                "pid": rank, "tid": tid, "cat": cat, "args": event_args,
            })
        return {"traceEvents": events,
                "metadata": dict(self._metadata, dropped_iterations=self._dropped_iterations)}

    def flush(self) -> None:
        """Writes everything recorded so far, atomically: readers see the old or the new file."""
        write_json_atomic(self.path, self.to_chrome())

    def close(self) -> None:
        """Writes the file; later calls do nothing (safe from ``finally`` and ``atexit`` alike)."""
        if self._closed:
            return
        self._closed = True
        self._gc_timer.uninstall()
        self.flush()
        log.info("rank %d: wrote %d trace events to %s%s", self.rank, self.num_events, self.path,
                    f" ({self._dropped_iterations} earlier iterations dropped)" if self._dropped_iterations else "")


def write_json_atomic(path: Path, document: Any) -> None:
    """Writes ``document`` as JSON through a temporary file in the same folder and os.replace.

    A rank killed mid-write leaves the previous file (or none), never half a JSON document.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; the file gets the mode any other file of the run gets (0666 less
        # the umask), so the group that reads the run folder reads its traces and summaries too.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as out:
            # One dumps + write is several times faster than json.dump's many small writes.
            out.write(json.dumps(document, separators=(",", ":")))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask, read where Linux shows it: setting it to read it (os.umask) would, for an
    instant, apply to files other threads of a rank create."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_tracer(profile_dir: str | os.PathLike[str] | None, rank: int, metadata: Mapping[str, Any],
                keep_iterations: int | None = DEFAULT_KEEP_ITERATIONS) -> Tracer | NullTracer:
    """A :class:`Tracer` writing ``<profile_dir>/trace_rank<RANK>.json`` (a requeued job's later
    segments: ``<profile_dir>/segment<N>/``, :func:`segment_folder`), or a :class:`NullTracer` when
    ``profile_dir`` is None (profiling off).

    ``metadata`` must hold the keys of :data:`REQUIRED_METADATA`; ``tp_rank``/``dp_rank`` default
    to 0; ``segment`` defaults to :func:`segment_from_env`; ``rank``, ``source``, ``clock_offset_us``
    and ``dropped_iterations`` are filled in here.
    The tracer keeps the latest ``keep_iterations`` iterations (None: all of them).
    """
    if profile_dir is None:
        return NullTracer()
    problems = [f"missing metadata key {key!r}" for key in REQUIRED_METADATA if key not in metadata]
    if not isinstance(rank, int) or rank < 0:
        problems.append(f"rank={rank!r} must be an int >= 0")
    if keep_iterations is not None and (not isinstance(keep_iterations, int) or keep_iterations < 1):
        problems.append(f"keep_iterations={keep_iterations!r} must be None or an int >= 1")
    raise_if_any(problems, "make_tracer")
    # Created now rather than at close so that an unwritable folder fails at start-up, not
    # after hours of training.
    segment = int(metadata.get("segment", segment_from_env()))
    folder = segment_folder(profile_dir, segment)
    folder.mkdir(parents=True, exist_ok=True)
    return Tracer(folder / trace_file_name(rank), rank, {**metadata, "segment": segment}, keep_iterations)
