"""The per-rank tracer: file contract, no-op tracer, atomic writes, bad metadata."""

from __future__ import annotations

import json
import timeit

import pytest

from trainer.profiling.tracer import (
    REQUIRED_METADATA,
    NullTracer,
    Tracer,
    make_tracer,
    now_us,
    trace_file_name,
)

META = {"stage": 2, "world_size": 8, "pipeline_parallel": 4, "num_chunks": 1, "num_microbatches": 8,
        "schedule": "dpp", "tp_rank": 1, "dp_rank": 0, "run_id": "42.0-0badcafe"}


def test_off_means_null_tracer_and_no_file(tmp_path):
    tracer = make_tracer(None, rank=0, metadata={})
    assert isinstance(tracer, NullTracer) and not tracer.enabled
    # One shared context manager: no allocation per span when profiling is off.
    assert tracer.span("F0.c0", "F", microbatch=0) is tracer.span("B1.c0", "B", microbatch=1)
    with tracer.span("F0.c0", "F") as span:
        span.set(inflight=1)
    tracer.record("send act m0.c0", "send", 1.0, 2.0, tid="comm")
    tracer.set_iteration(3)
    tracer.set_clock_offset(12.5)
    tracer.close()
    assert list(tmp_path.iterdir()) == []


def test_trace_file_follows_the_contract(tmp_path):
    tracer = make_tracer(tmp_path / "prof", rank=5, metadata=META)
    assert isinstance(tracer, Tracer) and tracer.enabled
    tracer.set_iteration(4)
    before = now_us()
    with tracer.span("F3.c0", "F", microbatch=3, chunk=0) as span:
        span.set(inflight=2)
    after = now_us()
    tracer.record("send act m3.c0", "send", after, after + 7.5, tid="comm", microbatch=3, chunk=0)
    tracer.set_clock_offset(-123.25)
    tracer.close()

    path = tmp_path / "prof" / "trace_rank00005.json"
    assert path.name == trace_file_name(5)
    document = json.loads(path.read_text())
    meta = document["metadata"]
    assert {k: meta[k] for k in META} == META
    assert (meta["rank"], meta["source"], meta["clock_offset_us"]) == (5, "runtime", -123.25)
    forward, send = document["traceEvents"]
    assert forward["name"] == "F3.c0" and forward["ph"] == "X" and forward["cat"] == "F"
    assert (forward["pid"], forward["tid"]) == (5, "compute")
    assert before <= forward["ts"] <= forward["ts"] + forward["dur"] <= after
    assert forward["args"] == {"iteration": 4, "stage": 2, "microbatch": 3, "chunk": 0, "inflight": 2}
    assert (send["tid"], send["cat"], send["dur"]) == ("comm", "send", 7.5)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_span_is_recorded_when_the_block_raises(tmp_path):
    tracer = make_tracer(tmp_path, rank=0, metadata=META)
    with pytest.raises(RuntimeError), tracer.span("B0.c0", "B", microbatch=0, chunk=0):
        raise RuntimeError("boom")
    # A garbage collection that falls inside the block is recorded too, as its own "gc" span.
    spans = [e for e in tracer.to_chrome()["traceEvents"] if e.get("ph") == "X" and e["cat"] != "gc"]
    assert [e["name"] for e in spans] == ["B0.c0"]


def test_close_is_idempotent_and_flush_rewrites(tmp_path):
    tracer = make_tracer(tmp_path, rank=1, metadata=META)
    tracer.record("F0.c0", "F", 0.0, 1.0)
    tracer.flush()
    path = tmp_path / trace_file_name(1)
    assert len(json.loads(path.read_text())["traceEvents"]) == 1
    tracer.record("B0.c0", "B", 1.0, 3.0)
    tracer.close()
    tracer.record("F1.c0", "F", 3.0, 4.0)  # after close: kept in memory, never written again
    tracer.close()
    assert len(json.loads(path.read_text())["traceEvents"]) == 2


def test_missing_metadata_and_bad_rank_are_named(tmp_path):
    with pytest.raises(ValueError) as err:
        make_tracer(tmp_path, rank=-1, metadata={"stage": 0})
    message = str(err.value)
    for key in REQUIRED_METADATA[1:]:
        assert repr(key) in message
    assert "rank=-1" in message
    assert list(tmp_path.iterdir()) == []


def test_span_overhead_is_microseconds(tmp_path):
    """Guards the design goal (a tuple append per span); the real figures are in docs/profiling.md."""
    tracer = make_tracer(tmp_path, rank=0, metadata=META)

    def span_on():
        with tracer.span("F3.c0", "F", microbatch=3, chunk=0):
            pass

    per_span_us = min(timeit.repeat(span_on, number=20_000, repeat=3)) / 20_000 * 1e6
    # ~1 µs on an idle core; 25 µs leaves room for a loaded CI machine and still catches a
    # regression to per-span JSON/dict work or I/O.
    assert per_span_us < 25.0, per_span_us


def test_overhead_benchmark_reports_every_variant(capsys):
    from trainer.profiling import overhead

    assert overhead.main(["--calls", "2000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(":")[0].strip() for line in lines]
    assert names == ["bare block", "NullTracer.span", "Tracer.span", "Tracer.record", "close() per event"]
    assert all(float(line.split(":")[1].split()[0]) > 0 for line in lines)


def test_only_the_latest_iterations_are_kept(tmp_path):
    tracer = make_tracer(tmp_path, rank=0, metadata=META, keep_iterations=3)
    for iteration in range(7):
        tracer.set_iteration(iteration)
        tracer.record(f"F{iteration}.c0", "F", 0.0, 1.0, microbatch=iteration, chunk=0)
        tracer.record(f"B{iteration}.c0", "B", 1.0, 2.0, microbatch=iteration, chunk=0)
    assert tracer.num_events == 6
    tracer.close()
    document = json.loads((tmp_path / trace_file_name(0)).read_text())
    assert [e["args"]["iteration"] for e in document["traceEvents"]] == [4, 4, 5, 5, 6, 6]
    assert document["metadata"]["dropped_iterations"] == 4
    with pytest.raises(ValueError, match="keep_iterations=0"):
        make_tracer(tmp_path, rank=0, metadata=META, keep_iterations=0)


def test_garbage_collections_are_gc_spans_until_close(tmp_path):
    """Each Python collection while a tracer is open is a "gc" span on thread "gc" (a collection
    stops the host wherever it runs); close() unhooks the tracer from the collector."""
    import gc

    automatic = gc.isenabled()
    gc.disable()  # only the collections this test asks for
    try:
        tracer = make_tracer(tmp_path, rank=0, metadata=META)
        tracer.set_iteration(3)
        before = now_us()
        gc.collect()
        gcs = [e for e in tracer.to_chrome()["traceEvents"] if e["cat"] == "gc"]
        assert len(gcs) == 1 and gcs[0]["name"] == "gc gen2" and gcs[0]["tid"] == "gc", gcs
        assert before <= gcs[0]["ts"] and gcs[0]["dur"] > 0
        assert gcs[0]["args"]["iteration"] == 3 and gcs[0]["args"]["generation"] == 2
        tracer.close()
        gc.collect()
        assert [e for e in tracer.to_chrome()["traceEvents"] if e["cat"] == "gc"] == gcs
    finally:
        if automatic:
            gc.enable()
