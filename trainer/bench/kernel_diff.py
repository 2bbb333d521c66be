"""Where two lines' GPU busy time differs, by kernel: the report's answer to "the same kernels, so why is
this stage busier?" (a split backward's operand copies, a graph's input copies, a slower GEMM shape).

Each rank's metrics carry the kernel profiler's per-name table (trainer/profiling/gpu_busy.py,
``by_kernel``: summed kernel time and calls per profiled iteration). Per stage (mean over its ranks) the
report lists the kernel names whose time differs most between the headline's DPP line and the static
bar, and the difference of all kernels' summed time. Summed time is not busy time (kernels of two
streams may overlap), but its differences name what the busy column's difference is made of.
"""

from __future__ import annotations

import re
import statistics

from trainer.bench.results import LineResult

ROWS_PER_STAGE = 6
"""How many kernel names each stage lists (the largest absolute differences)."""

MIN_DIFFERENCE_MS = 0.5
"""Smaller differences per iteration are not listed (noise between two runs of the same kernels)."""

_INNER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:Functor[A-Za-z0-9_]*|_kernel_cuda|_kernel|Kernel|Op)\b")


def short_name(name: str, width: int = 96) -> str:
    """A kernel's name for a table cell: without ``void`` and argument lists; for a templated kernel its
    head and the functors/kernels named among its template arguments (``elementwise_kernel<...
    direct_copy_kernel_cuda ...>`` says which elementwise op it is)."""
    name = re.sub(r"\s+", " ", name).removeprefix("void ").strip()
    head, angle, rest = name.partition("<")
    head = head.split("(")[0].strip()
    if angle:
        inner = [m for m in dict.fromkeys(_INNER.findall(rest)) if m not in head]
        if inner:
            head = f"{head}<{', '.join(inner[:3])}>"
    return head if len(head) <= width else head[:width - 1] + "…"


def stage_kernels(result: LineResult) -> dict[int, dict[str, tuple[float, float]]]:
    """Stage -> kernel name -> (ms, calls) per iteration, the mean over the stage's ranks."""
    per_stage: dict[int, list[dict[str, tuple[float, float]]]] = {}
    for doc in result.metrics:
        table = (doc.get("gpu_busy") or {}).get("by_kernel") or []
        if table:
            per_stage.setdefault(doc["stage"], []).append({row["name"]: (row["ms"], row["calls"]) for row in table})
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for stage, ranks in sorted(per_stage.items()):
        names = {name for rank in ranks for name in rank}
        out[stage] = {name: (statistics.fmean(r.get(name, (0.0, 0.0))[0] for r in ranks),
                             statistics.fmean(r.get(name, (0.0, 0.0))[1] for r in ranks)) for name in names}
    return out


def _cell(name: str) -> str:
    return "`" + short_name(name).replace("|", "\\|").replace("`", "'") + "`"


def kernel_differences(line: LineResult, bar: LineResult, rows: int = ROWS_PER_STAGE) -> list[str]:
    """The report's section: per stage the kernel names whose time per iteration differs most between
    ``line`` and ``bar`` (empty when either ran without the kernel table, e.g. on CPU)."""
    ours, theirs = stage_kernels(line), stage_kernels(bar)
    stages = sorted(set(ours) & set(theirs))
    if not stages or line is bar:
        return []
    out = [f"GPU time by kernel, **{line.name}** against **{bar.name}** (kernel profiler; ms per iteration, "
           "mean over the profiled iterations and the stage's ranks; the names whose time differs most, "
           f"differences under {MIN_DIFFERENCE_MS} ms left out; \"all kernels\" sums every kernel's time, "
           "so overlapping kernels count twice):", "",
           f"| stage | kernel | {bar.name} ms | {line.name} ms | difference ms | calls ({bar.name} → {line.name}) |",
           "|---|---|---|---|---|---|"]
    for stage in stages:
        a, b = theirs[stage], ours[stage]
        total_a, total_b = sum(ms for ms, _ in a.values()), sum(ms for ms, _ in b.values())
        out.append(f"| {stage} | all kernels | {total_a:.1f} | {total_b:.1f} | {total_b - total_a:+.1f} | |")
        diffs = sorted(((b.get(n, (0.0, 0.0))[0] - a.get(n, (0.0, 0.0))[0], n) for n in set(a) | set(b)),
                       key=lambda d: (-abs(d[0]), d[1]))
        for delta, name in [d for d in diffs if abs(d[0]) >= MIN_DIFFERENCE_MS][:rows]:
            (ms_a, calls_a), (ms_b, calls_b) = a.get(name, (0.0, 0.0)), b.get(name, (0.0, 0.0))
            out.append(f"| {stage} | {_cell(name)} | {ms_a:.1f} | {ms_b:.1f} | {delta:+.1f} | "
                       f"{calls_a:.0f} → {calls_b:.0f} |")
    return out + [""]

