"""Why an iteration took as long as it did: its critical path through the stages' ops.

    python -m trainer.profiling.critical_path --benchmark_dir DIR [--iterations 3,4] [--spans gpu|host] [--detail]
    python -m trainer.profiling.critical_path --trace FILE ...   # one trace file (merged, or the simulator's)

Per-stage busy time says which GPU worked most, not what the step waited for. This walks one
iteration backwards from the op that ended last: each op was held back either by the op before it
on its stage's stream or by the producer of its input (an F by the upstream F of its microbatch, an
I/B by the downstream I/B), whichever ended later. The chain of those ops is the critical path; its
length is the iteration's span, split into op time per stage and kind and into the gaps between
them (transfers, launches, host decisions).

It also counts **backwards queued behind a weight gradient**: an I or B whose input gradient was on
the stage (its producer had ended) before the stage's previous op, a deferred W, even started — so
a W decided on the host before that gradient's header arrived held it back for the W's whole run.
That is dpp-zb's host-time hazard (docs/schedules.md, host-time decisions); the delay is summed per
stage.

Spans: ``gpu`` (CUDA runs traced with --profile-dir: each op's GPU time from CUDA events) or
``host`` (CPU runs, where an op runs while its host span lasts; also simulator traces). Where a stage
has several ranks (TP/DP replicas), the lowest rank stands for it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.cli import OneLineParser
from trainer.profiling.loading import load_rank_traces, read_trace_file
from trainer.profiling.merge import merge_traces

COMPUTE_OPS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class OpSpan:
    stage: int
    op: str
    microbatch: int
    chunk: int
    start: float
    end: float
    """Microseconds."""

    @property
    def label(self) -> str:
        return f"s{self.stage}:{self.op}{self.microbatch}.c{self.chunk}"


@dataclass
class PathReport:
    iteration: int
    span_ms: float
    """First op start to last op end over all stages."""
    path: list[tuple[OpSpan, float]]
    """Critical path, first op first: (op, gap before it in ms)."""
    op_ms: dict[tuple[int, str], float] = field(default_factory=dict)
    """(stage, op kind) -> time of that stage's ops of that kind on the path."""
    gap_ms: float = 0.0
    """Time on the path between ops (transfers, launches, decisions)."""
    stream_gap_ms: float = 0.0
    """The part of ``gap_ms`` between two ops of one stage: its GPU idled with the input there --
    waiting for its host (a decision, a launch, a Python pause), not for a neighbour."""
    largest_gaps: list[tuple[float, str, str]] = field(default_factory=list)
    """The three longest gaps on the path: (ms, the op that waited, "stream" or "input")."""
    inside_wait_ms: float = 0.0
    """Time path ops' spans ran before the op that held them back had ended: a wait for the input
    queued *inside* the op's span, counted here and not as op time (traces taken before the runtime
    queued that wait ahead of the span's start event)."""
    gap_host_ms: dict[str, float] = field(default_factory=dict)
    """What the stage's host did during the path's gaps on one stage (``stream_gap_ms``), by
    activity (:data:`HOST_ACTIVITIES`); empty where the trace has no host spans to read."""
    behind_w_ms: dict[int, float] = field(default_factory=dict)
    """stage -> summed delay of backwards queued behind a W started after their gradient was there."""
    behind_w_count: dict[int, int] = field(default_factory=dict)


def _op_of(event: dict[str, Any]) -> str | None:
    args = event.get("args", {})
    op = args.get("op")
    if op in COMPUTE_OPS:
        return op
    name = event.get("name", "")
    if name[:1] in COMPUTE_OPS and event.get("cat") in COMPUTE_OPS + ("gpu",):
        return name[:1]
    return None


def collect_spans(merged: dict[str, Any], spans: str = "gpu",
                  ranks: dict[int, int] | None = None) -> dict[int, dict[int, list[OpSpan]]]:
    """iteration -> stage -> its ops in stream order. ``spans``: "gpu" (cat gpu) or "host" (F/B/I/W).
    ``ranks``, if given, is filled with stage -> the rank read for it (the lowest)."""
    if spans not in ("gpu", "host"):
        raise ValueError(f"spans={spans!r} must be 'gpu' or 'host'")
    rank_of_stage: dict[int, int] = {} if ranks is None else ranks
    picked: list[dict[str, Any]] = []
    for event in merged["traceEvents"]:
        if event.get("ph") != "X":
            continue
        cat = event.get("cat")
        if (spans == "gpu") != (cat == "gpu") or (spans == "host" and cat not in COMPUTE_OPS):
            continue
        args = event.get("args", {})
        if "microbatch" not in args or _op_of(event) is None:
            continue
        stage, rank = int(args["stage"]), int(args.get("rank", -1))
        rank_of_stage[stage] = min(rank, rank_of_stage.get(stage, rank))
        picked.append(event)
    out: dict[int, dict[int, list[OpSpan]]] = defaultdict(lambda: defaultdict(list))
    for event in picked:
        args = event["args"]
        stage = int(args["stage"])
        if int(args.get("rank", -1)) != rank_of_stage[stage]:
            continue
        out[int(args["iteration"])][stage].append(OpSpan(
            stage, _op_of(event), int(args["microbatch"]), int(args.get("chunk", 0)),  # type: ignore[arg-type]
            float(event["ts"]), float(event["ts"]) + float(event["dur"])))
    for stages in out.values():
        for ops in stages.values():
            ops.sort(key=lambda o: o.start)
    return out


HOST_ACTIVITIES = ("launch", "send", "wait", "run-ahead", "landed", "decide", "gc", "untraced")
"""What a host can be doing while its GPU idles with the next op's input there: queuing ops (an op's
host span: its launches, graph replays, Python), sending, waiting for an arrival, waiting for its own
GPU (--dpp-max-queued-ops), asking whether gradients landed (dpp-zb), the rest of a decision (reading
headers, the policy), a Python garbage collection (which stops the host inside whatever it was
doing, so it counts before the span it interrupted), or nothing the runtime traces (loop overhead,
a lazily loaded kernel's first launch)."""


@dataclass(frozen=True)
class HostSpan:
    start: float
    end: float
    """Microseconds, the rank's host clock (the gpu spans' axis)."""
    activity: str


def collect_host_spans(merged: dict[str, Any], ranks: dict[int, int]) -> dict[int, list[HostSpan]]:
    """stage -> the host spans of its rank ``ranks[stage]`` (the rank whose ops the path reads), a
    "decide" span cut into its run-ahead wait (first), its landed looks (last) and the rest."""
    stage_of = {rank: stage for stage, rank in ranks.items() if rank >= 0}  # the simulator's are -1: no host
    out: dict[int, list[HostSpan]] = defaultdict(list)
    for event in merged["traceEvents"]:
        if event.get("ph") != "X":
            continue
        args, cat = event.get("args", {}), event.get("cat")
        stage = stage_of.get(int(args.get("rank", -1)))
        if stage is None:
            continue
        start = float(event["ts"])
        end = start + float(event["dur"])
        if cat in COMPUTE_OPS:
            out[stage].append(HostSpan(start, end, "launch"))
        elif cat in ("send", "wait", "gc"):
            out[stage].append(HostSpan(start, end, cat))
        elif cat == "decide":
            bound = min(1e3 * float(args.get("run_ahead_ms", 0.0)), end - start)
            landed = min(1e3 * float(args.get("landed_ms", 0.0)), end - start - bound)
            for a, b, what in ((start, start + bound, "run-ahead"), (start + bound, end - landed, "decide"),
                               (end - landed, end, "landed")):
                if b > a:
                    out[stage].append(HostSpan(a, b, what))
    for spans in out.values():
        spans.sort(key=lambda h: h.start)
    return out


def host_activity(spans: Sequence[HostSpan], start: float, end: float) -> dict[str, float]:
    """Milliseconds of each activity in [start, end] (µs); where spans nest (a TP follower's wait
    inside its decision) the innermost, i.e. latest-starting, counts; time under no span is
    "untraced"."""
    inside = [h for h in spans if h.end > start and h.start < end]
    cuts = sorted({start, end, *(max(h.start, start) for h in inside), *(min(h.end, end) for h in inside)})
    out: dict[str, float] = {}
    for a, b in zip(cuts, cuts[1:], strict=False):
        active = [h for h in inside if h.start <= a and h.end >= b]
        what = max(active, key=lambda h: h.start).activity if active else "untraced"
        out[what] = out.get(what, 0.0) + (b - a) / 1000.0
    return out


def _neighbour(stage: int, chunk: int, step: int, p: int, v: int) -> tuple[int, int] | None:
    """(stage, chunk) of the virtual stage ``step`` away (+1 downstream, -1 upstream), interleaved
    placement: virtual stage c * p + s."""
    virtual = chunk * p + stage + step
    if virtual < 0 or virtual >= p * v:
        return None
    return virtual % p, virtual // p


def analyse(stages: dict[int, list[OpSpan]], iteration: int = 0,
            host: dict[int, list[HostSpan]] | None = None) -> PathReport:
    """The critical path of one iteration's ops (``stages``: stage -> ops in stream order); ``host``
    (stage -> :func:`collect_host_spans`): what each host did in the path's gaps on one stage."""
    if not stages or not any(stages.values()):
        raise ValueError(f"iteration {iteration}: no ops to analyse")
    p = max(stages) + 1
    v = 1 + max(o.chunk for ops in stages.values() for o in ops)
    index: dict[tuple[int, str, int, int], OpSpan] = {}
    previous: dict[OpSpan, OpSpan | None] = {}
    for ops in stages.values():
        for i, o in enumerate(ops):
            index[(o.stage, o.op, o.microbatch, o.chunk)] = o
            previous[o] = ops[i - 1] if i else None

    def producer(o: OpSpan) -> OpSpan | None:
        if o.op == "F":
            up = _neighbour(o.stage, o.chunk, -1, p, v)
            return index.get((up[0], "F", o.microbatch, up[1])) if up else None
        if o.op in ("B", "I"):
            down = _neighbour(o.stage, o.chunk, +1, p, v)
            if down is None:
                return None
            return (index.get((down[0], "I", o.microbatch, down[1]))
                    or index.get((down[0], "B", o.microbatch, down[1])))
        return None  # W: its own I, earlier on the same stream

    all_ops = [o for ops in stages.values() for o in ops]
    first = min(o.start for o in all_ops)
    last = max(all_ops, key=lambda o: o.end)
    report = PathReport(iteration, (last.end - first) / 1000.0, [])
    chain: list[tuple[OpSpan, float]] = []
    gaps: list[tuple[float, str, str]] = []
    cur: OpSpan | None = last
    while cur is not None:
        candidates = [c for c in (previous[cur], producer(cur)) if c is not None]
        pred = max(candidates, key=lambda c: c.end) if candidates else None
        gap = ((cur.start - pred.end) / 1000.0) if pred else 0.0
        chain.append((cur, gap))
        if pred is not None and gap > 0:
            same = pred.stage == cur.stage
            gaps.append((gap, cur.label, "stream" if same else "input"))
            if same:
                report.stream_gap_ms += gap
                _add_host_activity(report, (host or {}).get(cur.stage), pred.end, cur.start)
        cur = pred
    chain.reverse()
    report.path = chain
    report.largest_gaps = sorted(gaps, reverse=True)[:3]
    for o, gap in chain:
        # A negative gap: the op's span opened before what held it back had ended (it waited inside
        # its span). Only the part after that end is the op's own time, so op time plus gaps is the
        # path's length.
        inside = min(max(-gap, 0.0), (o.end - o.start) / 1000.0)
        key = (o.stage, o.op)
        report.op_ms[key] = report.op_ms.get(key, 0.0) + (o.end - o.start) / 1000.0 - inside
        report.inside_wait_ms += inside
        report.gap_ms += max(gap, 0.0)
    _count_behind_w(report, [(o, previous[o], producer(o) if o.op in ("B", "I") else None) for o in all_ops])
    return report


def _add_host_activity(report: PathReport, spans: Sequence[HostSpan] | None, start: float, end: float) -> None:
    if spans:  # a trace with no host spans of that stage (the simulator's) says nothing of its host
        for what, ms in host_activity(spans, start, end).items():
            report.gap_host_ms[what] = report.gap_host_ms.get(what, 0.0) + ms


def _count_behind_w(report: PathReport, ops: list[tuple[OpSpan, OpSpan | None, OpSpan | None]]) -> None:
    """``ops``: (op, the op before it on its stream, its input's producer)."""
    for o, before, src in ops:
        if before is None or src is None or before.op != "W":
            continue
        if src.end <= before.start:  # the gradient was there before the W began
            delay = (before.end - max(src.end, before.start)) / 1000.0
            report.behind_w_ms[o.stage] = report.behind_w_ms.get(o.stage, 0.0) + delay
            report.behind_w_count[o.stage] = report.behind_w_count.get(o.stage, 0) + 1


def report_dict(report: PathReport) -> dict[str, Any]:
    """``report`` as plain JSON values (the aggregation job's summary.json)."""
    op_ms: dict[str, dict[str, float]] = {}
    for (stage, kind), ms in sorted(report.op_ms.items()):
        op_ms.setdefault(f"s{stage}", {})[kind] = round(ms, 3)
    return {"iteration": report.iteration, "span_ms": round(report.span_ms, 3), "op_ms": op_ms,
            "gap_ms": round(report.gap_ms, 3), "stream_gap_ms": round(report.stream_gap_ms, 3),
            "inside_wait_ms": round(report.inside_wait_ms, 3),
            "gap_host_ms": {what: round(report.gap_host_ms[what], 3) for what in HOST_ACTIVITIES
                            if what in report.gap_host_ms},
            "largest_gaps": [{"ms": round(ms, 3), "before": label, "kind": kind} for ms, label, kind in report.largest_gaps],
            "behind_w": {f"s{s}": {"count": report.behind_w_count[s], "ms": round(report.behind_w_ms[s], 3)}
                         for s in sorted(report.behind_w_ms)},
            "path": [o.label for o, _ in report.path]}


def default_spans(merged: dict[str, Any]) -> str:
    """The spans to read from a merged trace: "gpu" where it has any (CUDA runs), else "host"."""
    return "gpu" if any(e.get("cat") == "gpu" for e in merged["traceEvents"]) else "host"


def _read(merged: dict[str, Any], spans: str) -> tuple[dict[int, dict[int, list[OpSpan]]], dict[int, list[HostSpan]]]:
    """(iteration -> stage -> ops, stage -> host spans of the rank read for it)."""
    ranks: dict[int, int] = {}
    by_iteration = collect_spans(merged, spans, ranks)
    return by_iteration, collect_host_spans(merged, ranks)


def critical_paths(merged: dict[str, Any], iterations: Sequence[int] | None = None) -> tuple[str, list[PathReport]]:
    """(the spans read, one report per iteration) of a merged trace: its :func:`default_spans`;
    ``iterations``: those only (default: all it has)."""
    spans = default_spans(merged)
    by_iteration, host = _read(merged, spans)
    wanted = [i for i in (iterations if iterations is not None else sorted(by_iteration)) if i in by_iteration]
    return spans, [analyse(by_iteration[i], i, host) for i in wanted]


def _host_text(ms: dict[str, float]) -> str:
    return ", ".join(f"{what} {ms[what]:.2f}" for what in HOST_ACTIVITIES if ms.get(what, 0.0) >= 0.005) or "-"


def format_report(report: PathReport, detail: bool = False) -> str:
    stages = sorted({s for s, _ in report.op_ms} | set(report.behind_w_ms))
    parts = []
    for s in stages:
        kinds = " ".join(f"{k} {report.op_ms[(s, k)]:.1f}" for k in COMPUTE_OPS if (s, k) in report.op_ms)
        parts.append(f"s{s}[{kinds}]" if kinds else f"s{s}[-]")
    behind = ", ".join(f"s{s} {report.behind_w_count[s]}x {report.behind_w_ms[s]:.1f} ms"
                       for s in sorted(report.behind_w_ms)) or "none"
    largest = ", ".join(f"{ms:.2f} before {label} ({kind})" for ms, label, kind in report.largest_gaps) or "none"
    lines = [f"iteration {report.iteration}: span {report.span_ms:.1f} ms; critical path {len(report.path)} ops: "
             f"{' '.join(parts)}; gaps {report.gap_ms:.1f} ms ({report.stream_gap_ms:.1f} on one stage; largest "
             f"{largest}); backwards queued behind a W: {behind}"
             + (f"; waits inside op spans {report.inside_wait_ms:.1f} ms" if report.inside_wait_ms >= 0.05 else "")
             + (f"; hosts in those one-stage gaps: {_host_text(report.gap_host_ms)}" if report.gap_host_ms else "")]
    if detail:
        lines.append("  " + " -> ".join(f"{o.label}" + (f" (+{gap:.2f})" if gap > 0.05 else "")
                                         for o, gap in report.path))
    return "\n".join(lines)


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m trainer.profiling.critical_path", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--benchmark_dir", help="a --profile-dir folder of one run (rank traces)")
    where.add_argument("--trace", help="one trace file: merged.json, or the simulator's --trace output")
    parser.add_argument("--iterations", default=None, help="comma-separated iterations (default: all traced)")
    parser.add_argument("--spans", choices=("gpu", "host"), default=None,
                        help="gpu: CUDA-event spans (default when the trace has them); host: F/B/I/W host spans")
    parser.add_argument("--detail", action="store_true", help="also print each path op by op")
    return parser


def _load(args: argparse.Namespace) -> dict[str, Any]:
    if args.trace:
        trace = read_trace_file(Path(args.trace))
        if trace.metadata.get("source") == "simulator":
            return merge_traces([trace])
        return {"traceEvents": trace.events, "metadata": trace.metadata}  # merged.json: already merged
    loaded = load_rank_traces(args.benchmark_dir)
    for problem in loaded.problems:
        print(f"critical_path: {problem}", file=sys.stderr)
    if not loaded.traces:
        raise ValueError(f"no readable rank trace in {args.benchmark_dir}")
    return merge_traces(loaded.traces, loaded.missing_ranks, loaded.problems)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    source = args.benchmark_dir or args.trace
    try:
        merged = _load(args)
    except ValueError as err:
        print(f"critical_path: {err}", file=sys.stderr)
        return 1
    spans = args.spans or default_spans(merged)
    by_iteration, host = _read(merged, spans)
    wanted = sorted(by_iteration)
    if args.iterations:
        try:
            wanted = [int(x) for x in args.iterations.split(",")]
        except ValueError:
            return parser.report(f"--iterations={args.iterations!r} must be comma-separated integers")
        missing = [i for i in wanted if i not in by_iteration]
        if missing:
            return parser.report(f"iterations {missing} not in the trace (it has {sorted(by_iteration)})")
    if not by_iteration:
        print(f"critical_path: {source} has no {spans} spans of F/B/I/W ops"
              + (" (a CUDA run traces them with --profile-dir; try --spans host)" if spans == "gpu" else ""),
              file=sys.stderr)
        return 1
    print(f"critical path ({spans} spans) of {source}")
    reports = [analyse(by_iteration[i], i, host) for i in wanted]
    for report in reports:
        print(format_report(report, args.detail))
    if len(reports) > 1:
        print(f"median span {statistics.median(r.span_ms for r in reports):.1f} ms over {len(reports)} iterations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
