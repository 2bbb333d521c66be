"""The aggregation job: merge, clock alignment, bubble arithmetic, damaged inputs, PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.profiling import aggregate
from trainer.profiling.loading import RankTrace, load_rank_traces
from trainer.profiling.merge import merge_traces
from trainer.profiling.summary import summarize
from trainer.profiling.synthetic import UniformCosts, rank_traces, simulated_trace, step_time_us
from trainer.profiling.tracer import trace_file_name
from trainer.profiling.validate import validate_trace

REPO = Path(__file__).resolve().parents[2]
COSTS = UniformCosts(num_stages=4, num_microbatches=8, forward_us=1000.0, backward_us=2000.0)


def _write_run(folder: Path, costs: UniformCosts = COSTS, iterations: int = 2,
               skew_us: tuple[float, ...] = (), **kwargs) -> dict[int, dict]:
    documents = rank_traces(costs, iterations=iterations, clock_skew_us=skew_us, **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    for rank, document in documents.items():
        (folder / trace_file_name(rank)).write_text(json.dumps(document))
    return documents


def _merged_from_document(document: dict) -> dict:
    return merge_traces([RankTrace(Path("sim.json"), document["traceEvents"], document["metadata"])])


def test_cli_merges_validates_and_summarises(tmp_path, capsys):
    _write_run(tmp_path / "run")
    assert aggregate.main(["--benchmark_dir", str(tmp_path / "run")]) == 0
    merged = json.loads((tmp_path / "run" / "merged.json").read_text())
    assert validate_trace(merged) == []
    x_events = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert len(x_events) == 2 * 4 * 8 * 2  # iterations x stages x microbatches x (F, B)
    assert {e["pid"] for e in x_events} == {0, 1, 2, 3}
    assert {e["tid"] for e in x_events} == {0}  # compute thread
    names = {(e["pid"], e["args"]["name"]) for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert names == {(s, f"stage {s} (rank {s})") for s in range(4)}
    threads = {e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"compute", "comm", "wait", "gpu", "gc"}  # gpu: CUDA-event op times (CUDA runs); gc: collections
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == [0, 1]
    assert summary["mean_iteration_time_ms"] == pytest.approx(step_time_us(COSTS) / 1000)
    assert [s["peak_inflight"] for s in summary["stages"]] == [4, 3, 2, 1]  # 1F1B holds p - s
    assert summary["median_op_ms"] == {"F": 1.0, "B": 2.0}
    # uniform 1F1B with no transfer time: the critical path covers the whole step, F0 of stage 0 first
    paths = summary["critical_path"]
    assert paths["spans"] == "host" and [p["iteration"] for p in paths["iterations"]] == [0, 1]
    first = paths["iterations"][0]
    assert first["path"][0] == "s0:F0.c0"
    assert sum(sum(k.values()) for k in first["op_ms"].values()) + first["gap_ms"] == pytest.approx(first["span_ms"])
    table = capsys.readouterr().out
    assert "critical path (host spans" in table and "iteration 1: span" in table
    assert "bubble fraction: 0.2727" in table and "merged 4 of 4 ranks" in table
    assert "dropped" not in table and merged["metadata"]["dropped_iterations"] == 0


@pytest.mark.parametrize(("stages", "microbatches"), [(4, 8), (4, 4), (2, 7), (8, 3), (1, 5)])
def test_uniform_1f1b_bubble_matches_theory(stages, microbatches):
    costs = UniformCosts(stages, microbatches, forward_us=700.0, backward_us=1400.0)
    summary = summarize(_merged_from_document(simulated_trace(costs, iterations=2)))
    theory = (stages - 1) / (microbatches + stages - 1)
    assert summary.bubble_fraction == pytest.approx(theory, abs=1e-9)
    assert all(s.bubble_fraction == pytest.approx(theory, abs=1e-9) for s in summary.stages)
    assert summary.theoretical_1f1b_bubble == pytest.approx(theory, abs=1e-12)


@pytest.mark.parametrize(("stages", "microbatches"), [(4, 8), (4, 32), (3, 5), (8, 8)])
def test_simulator_trace_bubble_matches_theory(stages, microbatches):
    """The schedule engine's own 1F1B policy and trace export, through our summary."""
    import numpy as np

    from trainer.schedule.core import PipelineShape
    from trainer.schedule.costs import CostModel
    from trainer.schedule.registry import make_policy
    from trainer.schedule.simulator import simulate
    from trainer.schedule.trace import trace_document

    shape = PipelineShape(num_stages=stages, num_microbatches=microbatches)
    policies = [make_policy("1f1b", shape, s) for s in range(stages)]
    costs = CostModel(forward=1.0, input_grad=1.0, weight_grad=1.0)
    result = simulate(shape, policies, costs.draw(shape, np.random.default_rng(0)), record=True)
    merged = _merged_from_document(trace_document(result, costs.transfer))
    assert validate_trace(merged) == []
    summary = summarize(merged)
    assert summary.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1), abs=1e-9)
    assert summary.stages[0].wait_ms > 0  # the simulator's waits are counted
    assert [s.peak_inflight for s in summary.stages] == [min(stages - s, microbatches) for s in range(stages)]


def test_skewed_clocks_come_out_aligned(tmp_path):
    skew = (0.0, 4_000_000.0, -2_500_000.0, 123_456.75)  # rank clocks ahead of rank 0 by this
    _write_run(tmp_path / "skewed", skew_us=skew)
    _write_run(tmp_path / "true")  # the same schedule on perfectly synchronised clocks
    merged = merge_traces(load_rank_traces(tmp_path / "skewed").traces)
    reference = merge_traces(load_rank_traces(tmp_path / "true").traces)

    def timing(doc):
        return {(e["pid"], e["args"]["iteration"], e["name"]): e["ts"]
                for e in doc["traceEvents"] if e["ph"] == "X"}

    got, want = timing(merged), timing(reference)
    assert got.keys() == want.keys()
    assert max(abs(got[k] - want[k]) for k in want) < 1.0  # µs; float64 at 1.7e15 µs has 0.25 µs steps
    assert summarize(merged).bubble_fraction == pytest.approx(3 / 11, abs=1e-6)
    assert merged["metadata"]["clock_offsets_us"]["1"] == -4_000_000.0

    # The same files with the offsets dropped are visibly misaligned: the test can fail.
    unaligned = load_rank_traces(tmp_path / "skewed").traces
    for trace in unaligned:
        trace.metadata["clock_offset_us"] = 0.0
    assert summarize(merge_traces(unaligned)).mean_iteration_time_ms > 4000


def test_missing_and_truncated_rank_files_are_named_and_the_rest_merge(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run)
    (run / trace_file_name(2)).unlink()
    truncated = run / trace_file_name(1)
    truncated.write_text(truncated.read_text()[:500])
    (run / ".trace_rank00003.json.x1.tmp").write_text("{")  # an interrupted atomic write: ignored

    assert aggregate.main(["--benchmark_dir", str(run), "--out", str(tmp_path / "out" / "m.json")]) == 0
    captured = capsys.readouterr()
    assert "trace_rank00002.json: missing" in captured.err
    assert "trace_rank00001.json: truncated or corrupt JSON" in captured.err
    assert "merged 2 of 4 ranks; missing or unreadable: 1, 2" in captured.out
    merged = json.loads((tmp_path / "out" / "m.json").read_text())
    assert merged["metadata"]["ranks"] == [0, 3]
    assert merged["metadata"]["missing_ranks"] == [1, 2]
    assert {e["args"]["stage"] for e in merged["traceEvents"] if e["ph"] == "X"} == {0, 3}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert any("trace_rank00001.json" in p for p in summary["problems"])
    assert summary["missing_ranks"] == [1, 2]


def test_no_readable_rank_is_an_error(tmp_path, capsys):
    (tmp_path / trace_file_name(0)).write_text("")
    assert aggregate.main(["--benchmark_dir", str(tmp_path)]) == 1
    assert "trace_rank00000.json: truncated or corrupt JSON" in capsys.readouterr().err
    assert not (tmp_path / "merged.json").exists()


def test_bad_iteration_writes_nothing(tmp_path, capsys):
    _write_run(tmp_path, iterations=2)
    assert aggregate.main(["--benchmark_dir", str(tmp_path), "--iteration", "7"]) == 2
    assert "--iteration 7 is not in the trace (traced: [0, 1])" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [trace_file_name(r) for r in range(4)]


def test_png_is_written_with_both_panels(tmp_path):
    _write_run(tmp_path / "run", iterations=2)
    (tmp_path / "sim.json").write_text(json.dumps(simulated_trace(COSTS)))
    single, double = tmp_path / "single.png", tmp_path / "double.png"
    assert aggregate.main(["--benchmark_dir", str(tmp_path / "run"), "--png", str(single)]) == 0
    assert aggregate.main(["--benchmark_dir", str(tmp_path / "run"), "--png", str(double),
                           "--compare", str(tmp_path / "sim.json"), "--iteration", "1"]) == 0

    import matplotlib.image

    one, two = matplotlib.image.imread(single), matplotlib.image.imread(double)
    assert one.shape[1] > 1000 and two.shape[0] > one.shape[0] * 1.5  # second panel below
    pixels = (one[..., :3] * 255).round().astype(int).reshape(-1, 3)
    colours = {tuple(p) for p in pixels}
    assert (0x4C, 0x72, 0xB0) in colours and (0x55, 0xA8, 0x68) in colours  # F blue, B green boxes
    assert len(colours) > 50  # text anti-aliasing: labels were drawn, not just flat boxes


def test_module_entry_point_runs(tmp_path):
    _write_run(tmp_path, iterations=1)
    done = subprocess.run([sys.executable, "-m", "trainer.profiling.aggregate", "--benchmark_dir",
                           str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "bubble fraction" in done.stdout
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda e: e.__setitem__("dur", -1.0), "dur=-1.0 is not a finite duration >= 0"),
    (lambda e: e.pop("ts"), "missing ts"),
    (lambda e: e.__setitem__("ts", float("nan")), "is not a finite µs timestamp"),
    (lambda e: e.__setitem__("name", "F9.c0"), "name does not match"),
    (lambda e: e.__setitem__("cat", "X"), "cat='X' not one of"),
])
def test_validate_flags_malformed_events(mutate, expected):
    merged = _merged_from_document(simulated_trace(COSTS))
    first = next(e for e in merged["traceEvents"] if e["ph"] == "X")
    mutate(first)
    assert any(expected in problem for problem in validate_trace(merged)), validate_trace(merged)


def test_validate_flags_missing_and_repeated_operations():
    merged = _merged_from_document(simulated_trace(COSTS))
    events = merged["traceEvents"]
    b5 = next(e for e in events if e.get("name") == "B5.c0" and e["pid"] == 2)
    events.remove(b5)
    events.append(dict(next(e for e in events if e.get("name") == "F1.c0" and e["pid"] == 0)))
    problems = validate_trace(merged)
    assert "pid 2 iteration 0: missing: B5.c0" in problems
    assert "pid 0 iteration 0: ran more than once: F1.c0" in problems


def test_validate_flags_seconds_instead_of_microseconds():
    document = simulated_trace(COSTS)
    for e in document["traceEvents"]:
        e["ts"], e["dur"] = e["ts"] / 1e6, e["dur"] / 1e6
    assert any("look like seconds" in p for p in validate_trace(_merged_from_document(document)))


def test_validate_flags_partially_overlapping_slices():
    merged = _merged_from_document(simulated_trace(COSTS))
    f0, f1 = (next(e for e in merged["traceEvents"] if e.get("name") == n and e["pid"] == 0)
              for n in ("F0.c0", "F1.c0"))
    f0["dur"] = (f1["ts"] - f0["ts"]) + f1["dur"] / 2  # F0 now ends halfway through F1
    assert "pid 0 tid 0: F1.c0 partially overlaps F0.c0" in validate_trace(merged)


def test_data_parallel_replicas_get_their_own_tracks():
    """PP=4 x DP=2: ranks 2s and 2s+1 hold stage s (Megatron order); each gets a pid, stage-major."""
    traces = []
    for rank, document in rank_traces(COSTS).items():
        for dp in range(2):
            global_rank = 2 * rank + dp
            events = [dict(e, pid=global_rank) for e in document["traceEvents"]]
            meta = dict(document["metadata"], rank=global_rank, dp_rank=dp, world_size=8)
            traces.append(RankTrace(Path(trace_file_name(global_rank)), events, meta))
    merged = merge_traces(traces)
    assert validate_trace(merged) == []
    labels = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert labels == {2 * s + dp: f"stage {s} (rank {2 * s + dp})" for s in range(4) for dp in range(2)}
    summary = summarize(merged)
    assert [s.ranks for s in summary.stages] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert summary.bubble_fraction == pytest.approx(3 / 11, abs=1e-9)


def test_malformed_rank_files_are_named(tmp_path):
    documents = _write_run(tmp_path, iterations=1)
    (tmp_path / trace_file_name(1)).write_text(json.dumps({"events": []}))
    (tmp_path / trace_file_name(2)).write_text(json.dumps(documents[3]))  # rank 3's trace, wrong name
    run = load_rank_traces(tmp_path)
    assert [t.rank for t in run.traces] == [0, 3]
    assert run.missing_ranks == [1, 2]
    assert run.problems == ["trace_rank00001.json: not a trace (no 'traceEvents' list)",
                            "trace_rank00002.json: metadata says rank 3; file skipped"]


def test_peak_inflight_is_replayed_when_not_reported():
    document = simulated_trace(COSTS)
    for event in document["traceEvents"]:
        del event["args"]["inflight"]
    summary = summarize(_merged_from_document(document))
    assert [s.peak_inflight for s in summary.stages] == [4, 3, 2, 1]


# ---- a folder mixing two runs is refused -------------------------------------------------------
def test_a_folder_mixing_two_runs_is_refused_naming_each_run(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run, run_id="101.0-aaaa0001")
    # A second, 100x slower run later wrote ranks 2 and 3 into the same folder (a reused --profile-dir).
    slow = UniformCosts(num_stages=4, num_microbatches=8, forward_us=100_000.0, backward_us=200_000.0)
    second = rank_traces(slow, iterations=2, run_id="202.0-bbbb0002", epoch_us=1.8e15)
    for rank in (2, 3):
        (run / trace_file_name(rank)).write_text(json.dumps(second[rank]))

    assert aggregate.main(["--benchmark_dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {run}: the traces come from 2 different runs (run 101.0-aaaa0001: "
                   "trace_rank00000.json, trace_rank00001.json; run 202.0-bbbb0002: trace_rank00002.json, "
                   "trace_rank00003.json); aggregate one run's folder (each run writes its own, runs/<run>/traces)")
    assert sorted(p.name for p in run.iterdir()) == [trace_file_name(r) for r in range(4)]  # nothing written


def test_one_runs_traces_merge_and_keep_the_run_id(tmp_path):
    _write_run(tmp_path, run_id="303.0-cccc0003")
    assert aggregate.main(["--benchmark_dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "merged.json").read_text())["metadata"]["run_id"] == "303.0-cccc0003"


# ---- the layer split the trace records ----------------------------------------------------------
@pytest.mark.parametrize(("recorded", "kept", "shown"), [
    ([4.5, 4, 4, 3.5], [4.5, 4, 4, 3.5], "layers 4.5/4/4/3.5"),  # --pipeline-stage-layers' half layers
    ([5.0, 4.0, 4.0, 3.0], [5, 4, 4, 3], "layers 5/4/4/3"),  # whole counts written as floats read as ints
])
def test_the_recorded_layer_split_reaches_the_stage_balance_unrounded(recorded, kept, shown):
    """Before: read with int(), 4.5 layers became 4 and the fit took the split for 15 layers."""
    document = simulated_trace(COSTS, iterations=2)
    document["metadata"]["layers_per_stage"] = recorded
    summary = summarize(_merged_from_document(document))
    assert summary.layers_per_stage == kept and [type(n) for n in summary.layers_per_stage] == [type(n) for n in kept]
    balance, why = aggregate.stage_balance_of(summary)
    assert balance is not None, why
    assert list(balance.layers) == kept and balance.costs.num_layers == 16
    from trainer.schedule.stage_balance import describe

    assert shown in describe(balance)
