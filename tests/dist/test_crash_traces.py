"""A crashed training run leaves the traces it had, tagged with one run id, and they aggregate
(the flush on crash is TrainingSession.flush_traces, called from main's handler)."""

from __future__ import annotations

import json

import pytest

from tests.dist.launch import launch
from tests.model_flags import model_flags
from trainer.profiling import aggregate
from trainer.profiling.tracer import trace_file_name

STAGES, CRASH_RANK, CRASH_AFTER, ITERATIONS = 2, 1, 2, 6


@pytest.mark.timeout(300)
def test_a_crashed_run_leaves_its_traces_and_they_aggregate(tmp_path, capsys):
    traces = tmp_path / "traces"
    args = ["tests.dist.crash_harness", str(CRASH_RANK), str(CRASH_AFTER), "--",
            *model_flags(seq=32, vocab=None), "--pipeline-model-parallel-size", str(STAGES),
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(ITERATIONS),
            "--use-dpp", "--dpp-timeout", "30", "--profile-dir", str(traces)]
    results = launch(args, STAGES, timeout_s=240)
    crashed = results[CRASH_RANK]
    assert crashed.returncode != 0 and "injected crash on rank 1 after iteration 2" in crashed.output, crashed.output

    # The crashed rank wrote what it had: the two iterations it finished (the tracer counts from 0).
    document = json.loads((traces / trace_file_name(CRASH_RANK)).read_text())
    traced = {e["args"]["iteration"] for e in document["traceEvents"] if e["cat"] in ("F", "B")}
    assert traced == set(range(CRASH_AFTER)), traced
    run_ids = {json.loads(p.read_text())["metadata"]["run_id"] for p in traces.glob("trace_rank*.json")}
    assert len(run_ids) == 1 and next(iter(run_ids)), run_ids  # one run, one non-empty id

    assert aggregate.main(["--benchmark_dir", str(traces)]) == 0, capsys.readouterr().err
    summary = json.loads((traces / "summary.json").read_text())
    assert set(range(CRASH_AFTER)) <= set(summary["iterations"])
