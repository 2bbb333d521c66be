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


def test_kernel_table_sums_time_and_calls_per_iteration_by_name() -> None:
    kernels = [("gemm", 100, 300), ("copy", 300, 350), ("gemm", 1100, 1200), ("gemm", 1900, 2100),
               ("ncclDevKernel_SendRecv", 400, 900)]
    table = summarize_kernels(kernels, [(3, 0, 1000), (4, 1000, 2000)])["by_kernel"]
    rows = {row["name"]: row for row in table}
    # gemm: 200 + 100 + 100 (clipped at the window's end) us over 2 iterations, 3 calls
    assert rows["gemm"]["ms"] == pytest.approx(0.2) and rows["gemm"]["calls"] == pytest.approx(1.5)
    assert rows["copy"]["ms"] == pytest.approx(0.025)
    assert rows["ncclDevKernel_SendRecv"]["ms"] == pytest.approx(0.25)  # listed, though not busy
    assert [row["name"] for row in table] == ["ncclDevKernel_SendRecv", "gemm", "copy"]


def test_kernel_table_keeps_the_longest_names_and_sums_the_rest() -> None:
    from trainer.profiling.gpu_busy import OTHER, kernel_table

    kernels = [(f"k{i}", 0, 10 * (i + 1)) for i in range(5)]
    table = kernel_table(kernels, [(0, 1000)], iterations=1, rows=2)
    assert [row["name"] for row in table] == ["k4", "k3", OTHER]
    assert table[-1]["ms"] == pytest.approx(0.06) and table[-1]["calls"] == 3
