"""The trace summary's GPU columns: "gpu" spans (CUDA-event op times) become per-stage GPU busy time."""

from __future__ import annotations

from trainer.profiling.summary import format_table, summarize


def _event(name: str, cat: str, ts: float, dur: float, stage: int, tid: str = "compute") -> dict:
    m = int(name[1:].split(".")[0]) if cat in ("F", "B", "gpu") else 0
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": stage, "tid": tid, "cat": cat,
            "args": {"iteration": 3, "stage": stage, "rank": stage, "microbatch": m, "chunk": 0}}


def _trace(with_gpu: bool) -> dict:
    events = [_event("F0.c0", "F", 0, 100, 0), _event("B0.c0", "B", 300, 100, 0),
              _event("F0.c0", "F", 100, 100, 1), _event("B0.c0", "B", 200, 100, 1)]
    if with_gpu:  # the GPU ran the ops later and for less than the host spans say
        events += [_event("F0.c0", "gpu", 50, 60, 0, "gpu"), _event("B0.c0", "gpu", 320, 70, 0, "gpu"),
                   _event("F0.c0", "gpu", 120, 40, 1, "gpu")]
    return {"traceEvents": events, "metadata": {"schedule": "dpp", "source": "runtime", "pipeline_parallel": 2,
                                                 "num_microbatches": 1}}


def test_gpu_busy_is_the_sum_of_gpu_spans_per_stage_and_shown_in_the_table() -> None:
    summary = summarize(_trace(with_gpu=True))
    assert [s.gpu_busy_ms for s in summary.stages] == [0.13, 0.04]
    # GPU step: first gpu start (50 us) to last gpu end (390 us) over all stages = 0.34 ms
    assert [round(s.gpu_idle_ms, 6) for s in summary.stages] == [0.21, 0.3]
    table = format_table(summary)
    assert "GPU busy ms" in table and "GPU idle ms" in table
    assert summary.median_op_ms == {"F": 0.1, "B": 0.1}  # gpu spans are not host compute spans


def test_without_gpu_spans_there_is_no_gpu_column() -> None:
    summary = summarize(_trace(with_gpu=False))
    assert all(s.gpu_busy_ms is None and s.gpu_idle_ms is None for s in summary.stages)
    assert "GPU busy" not in format_table(summary)
