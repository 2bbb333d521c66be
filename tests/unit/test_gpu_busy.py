"""trainer.profiling.gpu_busy: busy = union of non-NCCL kernels per iteration (pure part, no GPU)."""

from __future__ import annotations

import pytest

from trainer.profiling.gpu_busy import summarize_kernels, union_us


def test_union_merges_overlaps_and_small_gaps() -> None:
    assert union_us([(0, 10), (5, 20), (30, 40)]) == [(0, 20), (30, 40)]
    assert union_us([(0, 10), (15, 20)], gap_us=5) == [(0, 20)]


def test_kernels_fall_into_iterations_and_nccl_is_not_busy() -> None:
    kernels = [("gemm", 100, 300), ("softmax", 250, 400), ("ncclDevKernel_SendRecv", 400, 900),
               ("gemm", 1100, 1200), ("gemm", 1900, 2100)]
    out = summarize_kernels(kernels, [(3, 0, 1000), (4, 1000, 2000)])
    first, second = out["iterations"]
    assert first["iteration"] == 4 and first["compute_ms"] == pytest.approx(0.3)
    assert first["nccl_ms"] == pytest.approx(0.5)
    assert second["compute_ms"] == pytest.approx(0.2)  # the kernel crossing the boundary is clipped
    assert out["timeline"]["compute"] == [(1100, 1200), (1900, 2000)]


def test_clock_mismatch_is_reported_not_hidden() -> None:
    out = summarize_kernels([("gemm", 10, 20)], [(0, 5000, 6000)])
    assert "clock mismatch" in out["source"] and out["iterations"][0]["compute_ms"] == pytest.approx(0.01)
