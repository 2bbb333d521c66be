"""A requeued run's traces: every segment keeps its own files (segment N under ``segment<N>/``, from
$SLURM_RESTART_COUNT) and the aggregation merges them as one run with the segments marked. Before,
every segment wrote the same ``trace_rank*.json`` and the aggregation saw only the last one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.profiling import aggregate
from trainer.profiling.loading import load_rank_traces
from trainer.profiling.merge import merge_traces
from trainer.profiling.synthetic import UniformCosts, rank_traces
from trainer.profiling.tracer import make_tracer, segment_folder, segment_from_env, trace_file_name

COSTS = UniformCosts(num_stages=2, num_microbatches=4, forward_us=1000.0, backward_us=2000.0)
META = {"stage": 0, "world_size": 2, "pipeline_parallel": 2, "num_chunks": 1, "num_microbatches": 4,
        "schedule": "1f1b", "run_id": "r"}


@pytest.mark.parametrize("value, segment", [(None, 0), ("0", 0), ("2", 2), ("", 0), ("x", 0)])
def test_the_segment_is_slurms_restart_count(value, segment):
    assert segment_from_env({} if value is None else {"SLURM_RESTART_COUNT": value}) == segment


def test_a_requeued_rank_writes_into_its_segments_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    first = make_tracer(tmp_path, rank=0, metadata=META)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    second = make_tracer(tmp_path, rank=0, metadata=META)
    first.close()
    second.close()
    assert first.path == tmp_path / trace_file_name(0)
    assert second.path == segment_folder(tmp_path, 1) / trace_file_name(0) == tmp_path / "segment1" / "trace_rank00000.json"
    assert json.loads(second.path.read_text())["metadata"]["segment"] == 1
    assert json.loads(first.path.read_text())["metadata"]["segment"] == 0


def _write_segment(folder: Path, run_id: str, first_iteration: int, iterations: int, epoch_us: float) -> None:
    """One segment's rank files, its iterations numbered from ``first_iteration``."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank, document in rank_traces(COSTS, iterations=iterations, epoch_us=epoch_us, run_id=run_id).items():
        for event in document["traceEvents"]:
            event["args"] = dict(event.get("args") or {}, iteration=event["args"]["iteration"] + first_iteration)
        (folder / trace_file_name(rank)).write_text(json.dumps(document))


def test_segments_aggregate_as_one_run_the_repeated_iterations_taken_from_the_later_one(tmp_path, capsys):
    # Segment 0 traced iterations 1-5 and was preempted; its last checkpoint was at 4, so segment 1
    # (a new run token, a minute later) repeats 5 and goes on to 8.
    _write_segment(tmp_path, "job7-a", first_iteration=1, iterations=5, epoch_us=1.7e15)
    _write_segment(tmp_path / "segment1", "job7-b", first_iteration=5, iterations=4, epoch_us=1.7e15 + 60e6)
    # Segment 1's start-up (loading the checkpoint) ran a collection before its first step: the
    # tracer tags it with the iteration it starts from, which segment 0 computed.
    first = tmp_path / "segment1" / trace_file_name(0)
    document = json.loads(first.read_text())
    document["traceEvents"].insert(0, {"name": "gc gen2", "ph": "X", "ts": 1.7e15 + 59e6, "dur": 5.0, "pid": 0,
                                       "tid": "gc", "cat": "gc", "args": {"iteration": 1, "stage": 0}})
    first.write_text(json.dumps(document))
    loaded = load_rank_traces(tmp_path)
    assert loaded.problems == [] and [t.segment for t in loaded.traces] == [0, 0, 1, 1]
    merged = merge_traces(loaded.traces)
    segments = merged["metadata"]["segments"]
    assert [(s["segment"], s["run_id"], s["iterations"], s["superseded_iterations"]) for s in segments] == [
        (0, "job7-a", [1, 2, 3, 4], [5]), (1, "job7-b", [5, 6, 7, 8], [])]
    events = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    by_iteration = {(e["args"]["iteration"], e["args"]["segment"]) for e in events}
    assert by_iteration == {(i, 0) for i in range(1, 5)} | {(i, 1) for i in range(5, 9)}
    assert len(events) == 8 * 2 * 4 * 2  # iterations x stages x microbatches x (F, B): none twice

    assert aggregate.main(["--benchmark_dir", str(tmp_path)]) == 0
    assert ("merged 2 of 2 ranks over 2 segments of a requeued run (segment 0: iterations 1-4; segment 1: "
            "iterations 5-8)") in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["iterations"] == list(range(1, 9))


def test_two_runs_inside_one_segment_are_still_refused(tmp_path, capsys):
    _write_segment(tmp_path, "a", 1, 2, 1.7e15)
    _write_segment(tmp_path / "segment1", "b", 3, 2, 1.7e15 + 60e6)
    other = rank_traces(COSTS, iterations=1, run_id="c")[1]
    (tmp_path / "segment1" / trace_file_name(1)).write_text(json.dumps(other))
    assert aggregate.main(["--benchmark_dir", str(tmp_path)]) == 2
    assert "the traces of segment 1 come from 2 different runs" in capsys.readouterr().err


def test_a_missing_rank_of_a_later_segment_is_named_with_its_folder(tmp_path):
    _write_segment(tmp_path, "a", 1, 2, 1.7e15)
    _write_segment(tmp_path / "segment1", "b", 3, 2, 1.7e15 + 60e6)
    (tmp_path / "segment1" / trace_file_name(1)).unlink()
    loaded = load_rank_traces(tmp_path)
    assert loaded.problems == ["segment1/trace_rank00001.json: missing (rank 1 of world_size 2 wrote no trace)"]
    assert loaded.missing_ranks == [1]
