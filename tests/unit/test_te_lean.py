"""The dense-model Transformer Engine build (scripts/te/lean.py), checked without a GPU or TE's sources:
the CMake patch on a list shaped like TE's, its refusal of a release that renamed a file, and the
stub mechanism for real — a shared library whose kept object calls a C++ function of a left-out file
and an extension that binds a left-out nvte_* function, linked with g++, fail to load with RTLD_NOW
(as ctypes and CPython load TE) until the stubs generated from nm's view of them are linked in, and a
stub called from Python raises the recipe's message."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("te_lean", REPO / "scripts" / "te" / "lean.py")
lean = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lean)  # type: ignore[union-attr]

# TE's layout: three source lists, the last entry of each carrying the closing parenthesis.
CMAKELISTS = """\
list(APPEND transformer_engine_cpp_sources
     cudnn_utils.cpp
     transformer_engine.cpp)

list(APPEND transformer_engine_cuda_sources
     common.cu
     transpose/cast_transpose_fusion.cu
     fused_attn/fused_attn_f16_arbitrary_seqlen.cu
     fused_attn/fused_attn_fp8.cu
     fused_attn/utils.cu
     normalization/layernorm/ln_bwd_semi_cuda_kernel.cu
     normalization/layernorm/ln_fwd_cuda_kernel.cu
     normalization/rmsnorm/rmsnorm_bwd_semi_cuda_kernel.cu
     normalization/rmsnorm/rmsnorm_fwd_cuda_kernel.cu
     fused_router/fused_moe_aux_loss.cu
     fused_router/fused_score_for_moe_aux_loss.cu
     fused_router/fused_topk_with_score_function.cu)

list(APPEND transformer_engine_cuda_arch_specific_sources
     activation/gelu.cu
     activation/gelu_dbias.cu
     activation/gelu_grouped.cu
     activation/gelu_grouped_dbias.cu
     activation/glu.cu
     activation/relu.cu
     activation/relu_dbias.cu
     activation/relu_grouped.cu
     activation/relu_grouped_dbias.cu
     activation/scaled_activation.cu
     activation/scaled_srelu.cu
     activation/scaled_swiglu.cu
     activation/swiglu.cu
     activation/swiglu_dbias.cu
     activation/swiglu_grouped.cu
     activation/swiglu_grouped_dbias.cu
     cast/cast.cu
     cast/cast_dbias.cu
     cast/cast_grouped.cu
     cast/cast_grouped_dbias.cu
     gemm/cutlass_grouped_gemm.cu
     transpose/quantize_transpose_vector_blockwise_fp4.cu)

list(APPEND transformer_engine_SOURCES ${transformer_engine_cuda_arch_specific_sources}
                                       ${transformer_engine_cuda_sources}
                                       ${transformer_engine_cpp_sources})

set_property(SOURCE gemm/cutlass_grouped_gemm.cu APPEND PROPERTY COMPILE_OPTIONS "-g0")
"""


def _listed(text: str) -> list[str]:
    return [tok.rstrip(")") for block in lean._LIST_BLOCK.findall(text) for tok in block.split()[2:]]


def test_the_patch_leaves_out_exactly_the_listed_sources_and_keeps_the_lists_closed() -> None:
    patched = lean.patch_cmakelists(CMAKELISTS)
    before, after = _listed(CMAKELISTS), _listed(patched)
    assert set(before) - set(after) == set(lean.LEFT_OUT)
    assert set(after) == set(before) - set(lean.LEFT_OUT)
    # Each list still ends with its parenthesis (the arch-specific one lost its last entry).
    assert "transpose/quantize_transpose_vector_blockwise_fp4.cu" not in patched
    assert "cast/cast_dbias.cu)" in patched and "fused_attn/utils.cu" in patched
    assert patched.count("list(APPEND transformer_engine_") == CMAKELISTS.count("list(APPEND transformer_engine_") + 1
    assert f"list(APPEND transformer_engine_SOURCES {lean.STUB_FILE})" in patched
    assert "list(PREPEND transformer_engine_SOURCES transpose/cast_transpose_fusion.cu activation/gelu.cu" in patched
    # Properties set on a left-out source elsewhere are harmless and left alone.
    assert "SOURCE gemm/cutlass_grouped_gemm.cu" in patched


def test_the_patch_refuses_a_release_that_renamed_a_file_and_a_second_patch() -> None:
    renamed = CMAKELISTS.replace("activation/swiglu_grouped.cu", "activation/swiglu_group.cu")
    with pytest.raises(ValueError, match=r"activation/swiglu_grouped.cu \(to leave out\) is listed 0 times"):
        lean.patch_cmakelists(renamed)
    with pytest.raises(ValueError, match="already patched"):
        lean.patch_cmakelists(lean.patch_cmakelists(CMAKELISTS))


def test_te_symbols_are_the_c_api_and_the_namespace_only() -> None:
    assert lean.is_te_symbol("nvte_group_gelu")
    assert lean.is_te_symbol("_ZN18transformer_engine20cutlass_grouped_gemmEPKPvi")
    assert lean.is_te_symbol("_ZNK18transformer_engine6Tensor5shapeEv")
    assert not lean.is_te_symbol("_ZN3c104cuda20getCurrentCUDAStreamEa")
    assert not lean.is_te_symbol("cudaMalloc")
    assert lean.missing_symbols({"nvte_a", "cudaFree", "_ZN18transformer_engine1fEv"}, {"nvte_a"},
                                {"nvte_b", "_ZN2at6TensorD1Ev"}) == ["_ZN18transformer_engine1fEv", "nvte_b"]


def test_the_estimate_is_set_by_the_slowest_kept_file_on_16_cores() -> None:
    seconds = lean.read_seconds(REPO / "scripts" / "te" / "compile-seconds.txt")
    assert seconds["activation/swiglu_grouped.cu"] == pytest.approx(493.1)
    r = lean.estimate(seconds, cores=16, other_total=6337.0 - sum(seconds.values()),
                      other_count=95 - len(seconds), link_s=30.0)
    assert r["longest_s"] == pytest.approx(281.0)  # cast_transpose_fusion: the left-out ones are gone
    assert r["lpt_s"] == pytest.approx(281.0 + 30.0)
    assert r["lpt_s"] <= r["any_order_bound_s"] < 600


KEPT_CPP = """
namespace transformer_engine { void cutlass_grouped_gemm(const void **a, int n); }
extern "C" int nvte_kept(int n) { if (n < 0) transformer_engine::cutlass_grouped_gemm(nullptr, n); return n + 1; }
"""
EXT_CPP = """
extern "C" void nvte_group_gelu(const void *in, void *out, void *stream);
extern "C" int nvte_kept(int n);
extern "C" int ext_entry(int n) { if (n < 0) nvte_group_gelu(nullptr, nullptr, nullptr); return nvte_kept(n); }
"""
CALLER_CPP = """
#include <stdexcept>
extern "C" void nvte_group_gelu(const void *in, void *out, void *stream);
extern "C" int call_left_out() {
  try { nvte_group_gelu(nullptr, nullptr, nullptr); } catch (const std::runtime_error &e) { return 1; }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None, reason="needs g++ and nm")
def test_stubs_found_by_nm_make_both_libraries_load_and_a_stub_throws(tmp_path: Path) -> None:
    def so(name: str, sources: list[str], *link: str) -> Path:
        files = []
        for i, text in enumerate(sources):
            f = tmp_path / f"{name}_{i}.cpp"
            f.write_text(text)
            files.append(str(f))
        out = tmp_path / f"lib{name}.so"
        subprocess.run(["g++", "-shared", "-fPIC", "-o", str(out), *files, *link], check=True, timeout=120)
        return out

    def loads(*libs: Path) -> None:
        for lib in libs:  # TE opens the core with RTLD_GLOBAL; RTLD_NOW binds every symbol at once
            ctypes.CDLL(str(lib), mode=os.RTLD_NOW | os.RTLD_GLOBAL)

    core = so("core", [KEPT_CPP])
    ext = so("ext", [EXT_CPP])
    missing = lean.missing_symbols(lean._nm(core, "--undefined-only"), lean._nm(core, "--defined-only"),
                                   lean._nm(ext, "--undefined-only"))
    assert missing == ["_ZN18transformer_engine20cutlass_grouped_gemmEPPKvi", "nvte_group_gelu"]
    with pytest.raises(OSError, match="undefined symbol"):
        loads(core, ext)

    fixed = so("core_fixed", [KEPT_CPP, lean.stub_source(missing)])
    ext_fixed = so("ext_fixed", [EXT_CPP], f"-L{tmp_path}", "-l:libcore_fixed.so", f"-Wl,-rpath,{tmp_path}")
    assert lean.missing_symbols(lean._nm(fixed, "--undefined-only"), lean._nm(fixed, "--defined-only"),
                                lean._nm(ext_fixed, "--undefined-only")) == []
    loads(fixed, ext_fixed)
    assert ctypes.CDLL(str(ext_fixed)).ext_entry(41) == 42  # the kept function still works
    caller = so("caller", [CALLER_CPP], f"-L{tmp_path}", "-l:libcore_fixed.so", f"-Wl,-rpath,{tmp_path}")
    assert ctypes.CDLL(str(caller)).call_left_out() == 1  # the stub threw std::runtime_error
