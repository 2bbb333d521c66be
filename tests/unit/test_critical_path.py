"""trainer.profiling.critical_path: the critical path of a traced iteration and the backwards queued
behind a weight gradient, on simulator traces (same format as the runtime's) and hand-made spans."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainer.profiling.critical_path import OpSpan, analyse, format_report, main
from trainer.schedule.compare import ScheduleSpec
from trainer.schedule.costs import CostModel
from trainer.schedule.simulator import simulate
from trainer.schedule.trace import write_trace


def _spans(ops: list[tuple[int, str, int, float, float]]) -> dict[int, list[OpSpan]]:
    out: dict[int, list[OpSpan]] = {}
    for stage, op, m, start, end in ops:
        out.setdefault(stage, []).append(OpSpan(stage, op, m, 0, start * 1000, end * 1000))
    return out


def test_path_of_uniform_1f1b_runs_the_fill_and_the_last_stage() -> None:
    """1F1B, p = 2, M = 2, F = 1, B = 2, no transfer: the path is s0:F0 -> s1:F0 -> s1:B0 -> s1:F1 ->
    s1:B1 -> s0:B1 and its ops fill the whole span."""
    ops = [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 0, 4, 6), (0, "B", 1, 8, 10),
           (1, "F", 0, 1, 2), (1, "B", 0, 2, 4), (1, "F", 1, 4, 5), (1, "B", 1, 5, 7)]
    # s0:B1 needs s1:B1 (ends 7), s0's previous op B0 ends 6: the producer gates it, one unit late.
    report = analyse(_spans(ops))
    assert [o.label for o, _ in report.path] == ["s0:F0.c0", "s1:F0.c0", "s1:B0.c0", "s1:F1.c0", "s1:B1.c0",
                                                 "s0:B1.c0"]
    assert report.span_ms == pytest.approx(10.0)
    assert report.gap_ms == pytest.approx(1.0)
    assert report.stream_gap_ms == 0.0  # the one gap waited for stage 1's B1: an input
    assert report.largest_gaps == [(pytest.approx(1.0), "s0:B1.c0", "input")]
    assert sum(report.op_ms.values()) + report.gap_ms == pytest.approx(report.span_ms)
    assert report.behind_w_ms == {}


def test_a_backward_whose_gradient_was_there_before_a_w_started_is_counted() -> None:
    # stage 1: I0 at 2-3; W0 3-6 was queued although stage 2's I1 ended at 2.5 -> I1 waits 3 units.
    ops = [(1, "F", 0, 0, 1), (1, "F", 1, 1, 2), (1, "I", 0, 2, 3), (1, "W", 0, 3, 6), (1, "I", 1, 6, 7),
           (2, "I", 0, 1, 2), (2, "I", 1, 2, 2.5)]
    report = analyse(_spans(ops))
    assert report.behind_w_count == {1: 1}
    assert report.behind_w_ms[1] == pytest.approx(3.0)
    # the same W started before the gradient came: not counted (the W filled real idle time)
    late = [o if o[:3] != (2, "I", 1) else (2, "I", 1, 3.5, 4.0) for o in ops]
    assert analyse(_spans(late)).behind_w_ms == {}


def test_a_wait_inside_an_op_span_is_not_op_time() -> None:
    """An op whose GPU span opened before its input existed (the stream's wait for the payload queued
    inside the span, as 4-GPU traces once showed): op time is only the part after its
    producer ended, the rest is reported as a wait, and op time plus gaps is still the span."""
    # stage 1's F0 span opens at 0.2 while stage 0's F0 ends at 1 (off the path); F1's opens at 2,
    # when s0:F1 ends.
    ops = [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (1, "F", 0, 0.2, 1.5), (1, "F", 1, 2, 3)]
    report = analyse(_spans(ops))
    assert [o.label for o, _ in report.path] == ["s0:F0.c0", "s0:F1.c0", "s1:F1.c0"]
    assert report.op_ms == {(0, "F"): pytest.approx(2.0), (1, "F"): pytest.approx(1.0)}
    assert report.inside_wait_ms == 0.0  # s1:F1 opened at 2, when s0:F1 ended: no wait inside it
    late_open = [(0, "F", 0, 0, 1), (0, "F", 1, 1, 3), (1, "F", 0, 0.2, 2), (1, "F", 1, 2, 4)]
    report = analyse(_spans(late_open))  # s1:F1 opened at 2, s0:F1 ended at 3: 1 unit of waiting
    assert [o.label for o, _ in report.path] == ["s0:F0.c0", "s0:F1.c0", "s1:F1.c0"]
    assert report.inside_wait_ms == pytest.approx(1.0)
    assert report.op_ms[(1, "F")] == pytest.approx(1.0)
    assert sum(report.op_ms.values()) + report.gap_ms == pytest.approx(report.span_ms)
    assert "waits inside op spans 1.0 ms" in format_report(report)


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("dpp-zb", 1), ("dpp", 2)])
def test_path_covers_the_span_of_simulated_steps(name: str, v: int, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """On a simulated step (no transfer time) every moment of the span is on the path: op time plus
    gaps equals the span, and the path starts at stage 0's first forward."""
    spec = ScheduleSpec(name, num_chunks=v) if v > 1 else ScheduleSpec(name)
    shape, policies = spec.policies(4, 8)
    costs = CostModel(jitter=0.3).draw(shape, np.random.default_rng(3))
    result = simulate(shape, policies, costs, record=True)
    path = write_trace(tmp_path / "sim.json", result, transfer=0.0)
    assert main(["--trace", str(path), "--detail"]) == 0
    out = capsys.readouterr().out
    assert "iteration 0: span" in out and "s0:F0.c0 ->" in out
    from trainer.profiling.critical_path import collect_spans
    from trainer.profiling.loading import read_trace_file
    from trainer.profiling.merge import merge_traces
    report = analyse(collect_spans(merge_traces([read_trace_file(path)]), "host")[0])
    assert report.span_ms == pytest.approx(result.step_time)
    assert sum(report.op_ms.values()) + report.gap_ms == pytest.approx(report.span_ms)
    assert report.path[0][0].label == "s0:F0.c0"


def test_cli_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shape, policies = ScheduleSpec("1f1b").policies(2, 4)
    result = simulate(shape, policies, CostModel().draw(shape, np.random.default_rng(0)), record=True)
    path = write_trace(tmp_path / "sim.json", result)
    assert main(["--trace", str(path), "--spans", "gpu"]) == 1
    assert "no gpu spans" in capsys.readouterr().err
    assert main(["--trace", str(path), "--iterations", "5"]) == 2
    assert "iterations [5] not in the trace" in capsys.readouterr().err
    assert main(["--benchmark_dir", str(tmp_path / "empty")]) == 1


def test_what_the_host_did_while_its_gpu_idled_is_told() -> None:
    """A one-stage gap of 2 ms between two GPU spans is split by the rank's host spans: sending,
    the decide span cut into its run-ahead wait (first), landed looks (last) and the rest, the next
    op's launch, a garbage collection inside that launch, and the untraced remainder; the parts add
    up to the gap."""
    from trainer.profiling.critical_path import critical_paths, report_dict

    def event(cat: str, name: str, ts: float, dur: float, tid: str = "compute", **args) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
                "args": {"stage": 0, "rank": 0, "iteration": 3, **args}}

    op = {"microbatch": 0, "chunk": 0}
    merged = {"metadata": {}, "traceEvents": [
        event("gpu", "F0.c0", 0, 1000, "gpu", op="F", **op), event("gpu", "B0.c0", 3000, 1000, "gpu", op="B", **op),
        event("F", "F0.c0", 0, 100, **op), event("send", "send act m0.c0", 1000, 300, "comm"),
        event("decide", "decide", 1300, 1200, run_ahead_ms=0.2, landed_ms=0.3),
        event("B", "B0.c0", 2700, 250, **op), event("gc", "gc gen2", 2900, 50, "gc", generation=2),
        {"ph": "X", "cat": "wait", "name": "wait", "ts": 1000, "dur": 900, "pid": 1, "tid": "wait",
         "args": {"stage": 1, "rank": 1, "iteration": 3}},  # another rank's: not this stage's host
    ]}
    spans, (report,) = critical_paths(merged)
    assert spans == "gpu" and report.stream_gap_ms == pytest.approx(2.0)
    # the collection at 2.90-2.95 ms interrupted B0's launch (2.70-2.95): it counts as gc, not launch
    want = {"launch": 0.2, "send": 0.3, "run-ahead": 0.2, "landed": 0.3, "decide": 0.7, "gc": 0.05,
            "untraced": 0.25}
    assert report.gap_host_ms == pytest.approx(want)
    assert sum(report.gap_host_ms.values()) == pytest.approx(report.stream_gap_ms)
    assert report_dict(report)["gap_host_ms"] == pytest.approx(want)
    assert ("hosts in those one-stage gaps: launch 0.20, send 0.30, run-ahead 0.20, landed 0.30, decide 0.70, "
            "gc 0.05, untraced 0.25") in format_report(report)
