"""The trace-aggregation job: merge a run's per-rank traces, summarise them, draw the timeline.

    python -m trainer.profiling.aggregate --benchmark_dir DIR [--out merged.json] \
        [--compare sim.json] [--png timeline.png] [--iteration N]

Writes ``merged.json`` (Chrome trace format: open it in https://ui.perfetto.dev or
chrome://tracing), ``summary.json`` beside it and the PNG, and prints the per-stage table, the drawn
iteration's critical path and the stage balance (a persistently slow stage and the layer re-split
that fixes it, trainer/schedule/stage_balance.py).
Missing or unreadable rank files are reported by name and the other ranks still merge.
Exit status: 0 when at least one rank merged, 1 when none could be read, 2 for bad arguments or
a folder holding traces of several runs (then nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from trainer.cli import OneLineParser
from trainer.profiling.critical_path import PathReport, critical_paths, format_report, report_dict
from trainer.profiling.loading import load_rank_traces, read_trace_file
from trainer.profiling.merge import merge_traces
from trainer.profiling.plot import plot_timeline
from trainer.profiling.summary import TraceSummary, format_table, iterations_of, summarize
from trainer.profiling.tracer import write_json_atomic
from trainer.profiling.validate import validate_trace
from trainer.schedule.stage_balance import StageBalance, simulate_args, stage_balance
from trainer.schedule.stage_balance import describe as describe_balance


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m trainer.profiling.aggregate", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark_dir", "--benchmark-dir", required=True, type=Path,
                        help="folder holding the run's trace_rank*.json files (the run's --profile-dir)")
    parser.add_argument("--out", type=Path, default=None,
                        help="merged trace to write (default: BENCHMARK_DIR/merged.json); "
                             "summary.json goes beside it")
    parser.add_argument("--compare", type=Path, default=None,
                        help="simulator trace drawn as a second panel under the measured one")
    parser.add_argument("--png", type=Path, default=None,
                        help="timeline picture to write (default: BENCHMARK_DIR/timeline.png)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="summarise and draw only this iteration (default: summarise all, "
                             "draw the last one, which is past start-up effects)")
    return parser


def _load_compare(path: Path) -> dict[str, Any]:
    """The simulator's file, merged into the same shape as the measured trace."""
    trace = read_trace_file(path)
    return merge_traces([trace])


def _pick_compare_iteration(compare: dict[str, Any], wanted: int) -> int:
    """``wanted`` when the simulated trace has it, else its first iteration."""
    traced = iterations_of(compare)
    if not traced:
        raise ValueError("--compare trace has no compute events to draw")
    return wanted if wanted in traced else traced[0]


WARM_UP_ITERATIONS = 2
"""Iterations 1 and 2 (allocator, graph capture, first-touch) are left out of the stage balance
where later ones were traced, as the benchmark leaves them out of its timings."""


def stage_balance_of(summary: TraceSummary) -> tuple[StageBalance | None, str]:
    """The run's stage balance (trainer/schedule/stage_balance.py), or None and why not."""
    layers, stages = summary.layers_per_stage, len(summary.stages)
    if len(layers) < 2:
        return None, ("the trace does not record the layer split (traces of older runs, "
                      "simulated ones)" if not layers else "one stage: nothing to balance")
    if stages != len(layers):
        return None, f"{stages} of {len(layers)} stages traced"
    its = [it for it in summary.iterations if it > WARM_UP_ITERATIONS] or summary.iterations
    try:
        return stage_balance([summary.stage_busy_ms[it] for it in its], layers, summary.num_chunks), ""
    except ValueError as err:
        return None, str(err)


def _summary_document(summary: TraceSummary, problems: list[str], warnings: list[str],
                      compare: TraceSummary | None, paths: list[PathReport], spans: str,
                      balance: StageBalance | None, replay: list[str] | None) -> dict[str, Any]:
    document = summary.to_dict()
    document.update(problems=problems, validation_warnings=warnings)
    document["stage_balance"] = balance.to_dict() if balance is not None else None
    if balance is not None:
        document["stage_balance"]["simulate"] = replay
    document["critical_path"] = {"spans": spans, "iterations": [report_dict(r) for r in paths]}
    if compare is not None:
        document["compare"] = compare.to_dict()
    return document


def _span(iterations: list[int]) -> str:
    return "none" if not iterations else f"{iterations[0]}-{iterations[-1]}" if len(iterations) > 1 \
        else str(iterations[0])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or args.benchmark_dir / "merged.json"
    png = args.png or args.benchmark_dir / "timeline.png"
    try:
        run = load_rank_traces(args.benchmark_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for problem in run.problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not run.traces:
        print(f"error: no readable trace_rank*.json in {args.benchmark_dir}", file=sys.stderr)
        return 1

    try:
        merged = merge_traces(run.traces, run.missing_ranks, run.problems)
    except ValueError as err:  # traces of several runs: any number computed from them would be wrong
        print(f"error: {args.benchmark_dir}: {err}", file=sys.stderr)
        return 2
    warnings = validate_trace(merged)
    for warning in warnings:
        print(f"warning: trace: {warning}", file=sys.stderr)
    # Everything that can reject the arguments runs before the first file is written.
    try:
        summary = summarize(merged, args.iteration)
        draw = args.iteration if args.iteration is not None else summary.iterations[-1]
        compare = compare_summary = compare_iteration = None
        if args.compare is not None:
            compare = _load_compare(args.compare)
            compare_iteration = _pick_compare_iteration(compare, draw)
            compare_summary = summarize(compare, compare_iteration)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:  # why each iteration took as long as it did (trainer/profiling/critical_path.py)
        spans, paths = critical_paths(merged, summary.iterations)
    except ValueError as err:  # a damaged iteration: the rest of the summary still stands
        print(f"warning: critical path: {err}", file=sys.stderr)
        spans, paths = "none", []

    balance, no_balance = stage_balance_of(summary)
    replay = simulate_args(balance, summary.num_microbatches, summary.num_chunks) if balance is not None else None

    write_json_atomic(out, merged)
    write_json_atomic(out.parent / "summary.json",
                      _summary_document(summary, run.problems, warnings, compare_summary, paths, spans, balance,
                                        replay))
    plot_timeline(merged, png, draw, compare=compare, compare_iteration=compare_iteration)
    print(format_table(summary))
    drawn = [r for r in paths if r.iteration == draw]
    if drawn:
        print(f"critical path ({spans} spans; every iteration in summary.json): {format_report(drawn[0])}")
    print(describe_balance(balance) if balance is not None else f"stage balance: not computed ({no_balance})")
    if balance is not None and balance.persistent:
        print("  what the re-split buys the whole schedule: " + (
            f"python -m trainer.schedule.simulate {' '.join(replay)}" if replay is not None
            else "not simulated (the fitted stage speeds are more than the one slower stage the simulator takes)"))
    if compare_summary is not None:
        print(f"simulated ({compare_summary.schedule}): iteration {compare_iteration} "
              f"{compare_summary.mean_iteration_time_ms:.2f} ms, bubble {compare_summary.bubble_fraction:.4f}")
    if merged["metadata"]["dropped_iterations"]:
        print(f"note: the tracers kept the latest iterations only "
              f"({merged['metadata']['dropped_iterations']} earlier ones dropped)")
    merged_ranks = len({t.rank for t in run.traces})
    segments = merged["metadata"].get("segments", [])
    print(f"merged {merged_ranks} of {run.world_size} ranks"
          + (f" over {len(segments)} segments of a requeued run (" + "; ".join(
              f"segment {s['segment']}: iterations {_span(s['iterations'])}" for s in segments) + ")"
             if segments else "")
          + (f"; missing or unreadable: {', '.join(map(str, run.missing_ranks))}" if run.missing_ranks else ""))
    print(f"wrote {out}, {out.parent / 'summary.json'}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
