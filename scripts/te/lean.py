"""The dense-model Transformer Engine build: which of TE's core-library sources are left out, the
patch that leaves them out, and the stubs that keep the library and the PyTorch extension loading.

    python3 lean.py patch SRC_ROOT                 edit SRC_ROOT/transformer_engine/common/CMakeLists.txt
    python3 lean.py stubs SRC_ROOT CORE_SO EXT_SO  write the stubs for what the two libraries miss
    python3 lean.py check CORE_SO EXT_SO           exit 1 naming any symbol still missing
    python3 lean.py estimate SECONDS_FILE [CORES]  the core library's compile wall time, on paper

Why stubs: TE's own sources call into the left-out files (the cast dispatcher calls the NVFP4
transpose, the cuBLASLt GEMM calls the CUTLASS grouped GEMM for MoE), and the PyTorch extension binds
every nvte_* function. Both libraries are opened with RTLD_NOW (ctypes and CPython's extension loader
bind every symbol at load), so one missing symbol fails `import transformer_engine.pytorch`. The stubs
are found from the built libraries themselves (nm), not from reading C++: each is a function under the
missing symbol's exact (possibly mangled) name that throws when called, so a dense model loads the
library and a MoE/NVFP4 call fails loudly naming what is absent.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# Sources of transformer_engine/common left out, each with why a dense GPT/BERT never calls it. The
# compile seconds are one nvcc each for sm_90 in a full build on a 64-core machine (the probe's
# slowest-files list, scripts/te/compile-seconds.txt); the two files still compiling at 530 s when it
# stopped were grouped activations (the sources here without a figure), left out all the same.
LEFT_OUT: dict[str, str] = {
    # Grouped tensors: one kernel over the experts' token groups of a mixture-of-experts layer.
    "activation/gelu_grouped.cu": "MoE grouped activation",
    "activation/relu_grouped.cu": "MoE grouped activation",
    "activation/swiglu_grouped.cu": "MoE grouped activation (493 s)",
    "activation/gelu_grouped_dbias.cu": "MoE grouped activation backward (98 s)",
    "activation/relu_grouped_dbias.cu": "MoE grouped activation backward (91 s)",
    "activation/swiglu_grouped_dbias.cu": "MoE grouped activation backward",
    "cast/cast_grouped.cu": "MoE grouped quantize (341 s)",
    "cast/cast_grouped_dbias.cu": "MoE grouped quantize backward",
    "gemm/cutlass_grouped_gemm.cu": "MoE grouped GEMM (CUTLASS, sm_90a; 120 s)",
    # The MoE router (top-k with score function, auxiliary load-balancing loss).
    "fused_router/fused_topk_with_score_function.cu": "MoE router top-k (433 s)",
    "fused_router/fused_moe_aux_loss.cu": "MoE auxiliary loss",
    "fused_router/fused_score_for_moe_aux_loss.cu": "MoE auxiliary-loss scores",
    # Activations multiplied by per-row scales (the router's probabilities) before the expert GEMM.
    "activation/scaled_activation.cu": "router-probability-scaled activations (377 s)",
    "activation/scaled_srelu.cu": "router-probability-scaled squared ReLU",
    "activation/scaled_swiglu.cu": "router-probability-scaled SwiGLU",
    # NVFP4: 4-bit floating point needs Blackwell's tensor cores (sm_100+); Hopper never runs it.
    "transpose/quantize_transpose_vector_blockwise_fp4.cu": "NVFP4 blockwise quantize (Blackwell only; 362 s)",
}

# Kept sources put first in the build order, slowest first (the same measurement): ninja starts the
# longest compiles at once instead of after the queue reaches them.
SLOW_KEPT = [
    "transpose/cast_transpose_fusion.cu", "activation/gelu.cu", "activation/swiglu.cu", "activation/relu.cu",
    "fused_attn/fused_attn_f16_arbitrary_seqlen.cu", "fused_attn/fused_attn_fp8.cu", "fused_attn/utils.cu",
    "cast/cast.cu", "activation/relu_dbias.cu", "normalization/rmsnorm/rmsnorm_bwd_semi_cuda_kernel.cu",
    "activation/gelu_dbias.cu", "normalization/rmsnorm/rmsnorm_fwd_cuda_kernel.cu",
    "normalization/layernorm/ln_bwd_semi_cuda_kernel.cu", "normalization/layernorm/ln_fwd_cuda_kernel.cu",
    "activation/swiglu_dbias.cu", "activation/glu.cu", "cast/cast_dbias.cu",
]

STUB_FILE = "left_out_stubs.cpp"
_MARK = "# Dense-model build (scripts/te/lean.py)"
_LIST_BLOCK = re.compile(r"list\(APPEND transformer_engine_(?:cpp|cuda|cuda_arch_specific)_sources\b[^)]*\)", re.S)
_SOURCES_LINE = re.compile(r"^list\(APPEND transformer_engine_SOURCES [^)]*\)\n", re.M)


def patch_cmakelists(text: str) -> str:
    """TE's common/CMakeLists.txt without the LEFT_OUT sources, with the slow kept ones first and the
    stub file added. Refuses (ValueError) a text where a source to leave out or to move is not listed
    once: a TE release that renamed a file needs this list updated, not a silent full build."""
    if _MARK in text:
        raise ValueError("already patched (unpack the sources afresh)")
    blocks = _LIST_BLOCK.findall(text)
    if not blocks:
        raise ValueError("no list(APPEND transformer_engine_*_sources ...) block: not TE's common/CMakeLists.txt")
    listed = [tok.rstrip(")") for b in blocks for tok in b.split()[2:]]
    problems = [f"{src} (to leave out) is listed {listed.count(src)} times" for src in LEFT_OUT
                if listed.count(src) != 1]
    problems += [f"{src} (to build first) is listed {listed.count(src)} times" for src in SLOW_KEPT
                 if listed.count(src) != 1]
    if problems:
        raise ValueError("common/CMakeLists.txt does not match the recipe: " + "; ".join(problems))

    def drop(block: re.Match[str]) -> str:
        out = block.group(0)
        for src in LEFT_OUT:
            # The last entry of a list carries its closing parenthesis: keep that.
            out = re.sub(rf"\n\s*{re.escape(src)}(\)?)", lambda m: m.group(1), out)
        return out

    text = _LIST_BLOCK.sub(drop, text)
    if len(_SOURCES_LINE.findall(text)) != 1:
        raise ValueError("expected one list(APPEND transformer_engine_SOURCES ...) line")
    reorder = (f"{_MARK}: the slowest kept sources first, then the stubs of the left-out ones.\n"
               f"list(REMOVE_ITEM transformer_engine_SOURCES {' '.join(SLOW_KEPT)})\n"
               f"list(PREPEND transformer_engine_SOURCES {' '.join(SLOW_KEPT)})\n"
               f"list(APPEND transformer_engine_SOURCES {STUB_FILE})\n")
    return _SOURCES_LINE.sub(lambda m: m.group(0) + reorder, text)


def _nm(lib: Path, *flags: str) -> set[str]:
    out = subprocess.run(["nm", "-D", *flags, str(lib)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def is_te_symbol(name: str) -> bool:
    """TE's C API (nvte_*) or a function in its C++ namespace (mangled _ZN18transformer_engine...)."""
    return name.startswith("nvte_") or re.match(r"_ZN[KVR]*18transformer_engine", name) is not None


def missing_symbols(core_undefined: set[str], core_defined: set[str], ext_undefined: set[str]) -> list[str]:
    """TE symbols that the core library or the PyTorch extension needs and the core does not define."""
    return sorted(s for s in core_undefined | ext_undefined if is_te_symbol(s) and s not in core_defined)


def stub_source(symbols: list[str]) -> str:
    """C++ defining each symbol (its exact name through an asm label, so no signature is needed: a
    caller's arguments are ignored on x86-64) as a function that throws TE's usual runtime_error."""
    lines = ["// Generated by scripts/te/lean.py: the functions of the sources this dense-model build leaves",
             "// out. Each throws when called; nothing of a dense model calls one.",
             "#include <stdexcept>", "#include <string>", "",
             "namespace {",
             "[[noreturn]] void left_out(const char *name) {",
             '  throw std::runtime_error(std::string("Transformer Engine: ") + name +',
             '                           " is not in this build: scripts/te/build.sh leaves out the MoE "',
             '                           "(grouped, router, scaled) and NVFP4 kernels (docs/transformer_engine.md)");',
             "}", "}  // namespace", ""]
    for i, sym in enumerate(symbols):
        lines += [f'extern "C" void nvte_left_out_stub_{i}() __asm__("{sym}");',
                  f'extern "C" void nvte_left_out_stub_{i}() {{ left_out("{sym}"); }}']
    return "\n".join(lines) + "\n"


def _missing(core: Path, ext: Path) -> list[str]:
    return missing_symbols(_nm(core, "--undefined-only"), _nm(core, "--defined-only"), _nm(ext, "--undefined-only"))


def estimate(seconds: dict[str, float], cores: int, other_total: float, other_count: int,
             link_s: float) -> dict[str, float]:
    """Wall time of the lean core build on ``cores`` parallel compiles: the measured kept files, plus
    ``other_count`` files (those under the measured list's cut-off) sharing ``other_total`` seconds
    evenly, run longest first (the patched order), then the link. Also Graham's bound for any order:
    total/cores + (1 - 1/cores) * longest."""
    kept = sorted((s for f, s in seconds.items() if f not in LEFT_OUT), reverse=True)
    jobs = kept + [other_total / other_count] * other_count if other_count else kept
    free = [0.0] * cores
    for job in sorted(jobs, reverse=True):
        i = min(range(cores), key=free.__getitem__)
        free[i] += job
    total = sum(jobs)
    return {"cpu_s": total, "longest_s": max(jobs), "lpt_s": max(free) + link_s,
            "any_order_bound_s": total / cores + (1 - 1 / cores) * max(jobs) + link_s}


def read_seconds(path: Path) -> dict[str, float]:
    """``  493.1 s  CMakeFiles/transformer_engine.dir/activation/swiglu_grouped.cu.o`` lines."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([0-9.]+)\s*s\s+\S*transformer_engine\.dir/(\S+)\.o$", line)
        if m:
            out[m.group(2)] = float(m.group(1))
    return out


def main(argv: list[str]) -> int:
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "patch" and len(args) == 1:
        common = Path(args[0]) / "transformer_engine" / "common"
        cml = common / "CMakeLists.txt"
        try:
            cml.write_text(patch_cmakelists(cml.read_text()))
        except ValueError as e:
            print(f"lean.py: {cml}: {e}", file=sys.stderr)
            return 2
        (common / STUB_FILE).write_text(stub_source([]))
        print(f"lean.py: left out {len(LEFT_OUT)} sources of {cml}")
        return 0
    if cmd == "stubs" and len(args) == 3:
        missing = _missing(Path(args[1]), Path(args[2]))
        (Path(args[0]) / "transformer_engine" / "common" / STUB_FILE).write_text(stub_source(missing))
        print(f"lean.py: {len(missing)} stubs: " + " ".join(missing))
        return 0
    if cmd == "check" and len(args) == 2:
        missing = _missing(Path(args[0]), Path(args[1]))
        if missing:
            print(f"lean.py: still missing after the stubs ({len(missing)}): " + " ".join(missing), file=sys.stderr)
            return 1
        print("lean.py: every TE symbol the core library and the PyTorch extension need is defined")
        return 0
    if cmd == "estimate" and len(args) in (1, 2):
        seconds = read_seconds(Path(args[0]))
        cores = int(args[1]) if len(args) == 2 else 16
        # The probe: 95 of 98 steps done, 6,337 CPU-seconds; the files not in its list share the rest.
        other_count = 95 - len(seconds)
        other_total = 6337.0 - sum(seconds.values())
        r = estimate(seconds, cores, other_total, other_count, link_s=30.0)
        print(" ".join(f"{k}={v:.0f}" for k, v in r.items()) + f" cores={cores}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
