"""The report's per-kernel comparison of two lines (trainer/bench/kernel_diff.py)."""

from __future__ import annotations

from trainer.bench.kernel_diff import kernel_differences, short_name, stage_kernels
from trainer.bench.results import LineResult


def _line(name: str, tables: dict[int, list[list[dict]]]) -> LineResult:
    """A line whose ranks (per stage, one table each) carry kernel tables."""
    metrics = [{"stage": stage, "rank": 10 * stage + i, "gpu_busy": {"by_kernel": table}}
               for stage, ranks in tables.items() for i, table in enumerate(ranks)]
    return LineResult(key=f"a-{name}", name=name, scenario="a", label=name, metrics=metrics)


def test_short_names_say_which_elementwise_op() -> None:
    copy = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
            "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}> >(int, ...)")
    add = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
           "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)")
    assert short_name(copy) == "at::native::elementwise_kernel<direct_copy_kernel_cuda>"
    assert short_name(add) == "at::native::vectorized_elementwise_kernel<CUDAFunctor_add>"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    assert len(short_name("x" * 500)) == 96


def test_stage_kernels_average_the_stage_ranks() -> None:
    line = _line("l", {0: [[{"name": "gemm", "ms": 10.0, "calls": 4}],
                           [{"name": "gemm", "ms": 20.0, "calls": 4}, {"name": "copy", "ms": 2.0, "calls": 1}]]})
    assert stage_kernels(line) == {0: {"gemm": (15.0, 4.0), "copy": (1.0, 0.5)}}


def test_differences_name_the_kernels_that_grew_per_stage() -> None:
    bar = _line("1f1b-graphs", {0: [[{"name": "gemm", "ms": 100.0, "calls": 64}]],
                                1: [[{"name": "gemm", "ms": 90.0, "calls": 64},
                                     {"name": "softmax", "ms": 5.0, "calls": 32}]]})
    line = _line("dpp-zb-graphs", {0: [[{"name": "gemm", "ms": 100.2, "calls": 96}]],
                                   1: [[{"name": "gemm", "ms": 91.0, "calls": 96},
                                        {"name": "softmax", "ms": 5.0, "calls": 32},
                                        {"name": "Memcpy DtoD (Device -> Device)", "ms": 7.0, "calls": 32}]]})
    text = "\n".join(kernel_differences(line, bar))
    assert "| 1 | all kernels | 95.0 | 103.0 | +8.0 | |" in text
    assert "| 1 | `Memcpy DtoD` | 0.0 | 7.0 | +7.0 | 0 → 32 |" in text
    assert "| 1 | `gemm` | 90.0 | 91.0 | +1.0 | 64 → 96 |" in text
    assert "softmax" not in text  # no difference
    assert "| 0 | `gemm`" not in text  # 0.2 ms: under the noise floor
    # most different first
    assert text.index("Memcpy DtoD") < text.index("| 1 | `gemm`")


def test_no_section_without_kernel_tables_or_against_itself() -> None:
    bare = LineResult(key="a-x", name="x", scenario="a", label="x", metrics=[{"stage": 0, "rank": 0}])
    line = _line("l", {0: [[{"name": "gemm", "ms": 1.0, "calls": 1}]]})
    assert kernel_differences(line, bare) == []
    assert kernel_differences(line, line) == []
