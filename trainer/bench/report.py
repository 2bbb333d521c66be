"""The benchmark's markdown report and its timeline pictures (one per line and scenario)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from trainer.bench.kernel_diff import kernel_differences
from trainer.bench.lines import (
    MEGATRON_GRAPHED_LINES,
    MEGATRON_LINES,
    SCENARIOS,
    STATIC_EAGER_LINES,
    STATIC_GRAPHED_LINES,
    STATIC_LINES,
    BenchConfig,
    NotRun,
    base_name,
    layer_attention_share,
    line_entry,
    variable_length_args,
    variable_length_tokens,
)
from trainer.bench.results import LOSS_ITERATIONS, LineResult
from trainer.schedule.stage_parts import describe as describe_counts


def best_megatron(results: list[LineResult], scenario: str, eager_only: bool = False) -> LineResult | None:
    """Fastest of the trainer's megatron lines in ``scenario``: the bar every table ratio is taken against;
    ``eager_only``: without megatron-core's own graphs (MEGATRON_GRAPHED_LINES), the headline's first bar."""
    candidates = [r for r in results if r.ok and r.scenario == scenario and r.name in MEGATRON_LINES
                  and not (eager_only and r.name in MEGATRON_GRAPHED_LINES)]
    return min(candidates, key=lambda r: r.median_ms, default=None)


def _fmt(value: float | None, pattern: str = "{:.1f}") -> str:
    return "n/a" if value is None else pattern.format(value)


def _table(results: list[LineResult], scenario: str) -> list[str]:
    bar = best_megatron(results, scenario)
    rows = ["| line | layers/stage | ms/iter median | min–max | IQR | tokens/s | peak reserved GiB (max rank) | "
            f"peak allocated GiB | vs best megatron{f' ({bar.name})' if bar else ''} | reserved / its reserved | "
            "GPU busy ms/iter per stage | stalled ops |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in results if r.scenario == scenario):
        if not r.ok:
            rows.append(f"| {r.name} | | {r.status.splitlines()[0]} | | | | | | | | | |")
            continue
        lo, hi = r.iqr_ms
        ratio = f"{bar.median_ms / r.median_ms:.3f}x" if bar else "n/a"
        memory = (f"{r.reserved_gib / bar.reserved_gib:.3f}x" if bar and r.reserved_gib and bar.reserved_gib
                  else "n/a")
        busy = " / ".join(f"{ms:.0f}" for ms in r.busy_ms.values()) or "n/a"
        rows.append(f"| {r.name} | {describe_counts(r.layers_per_stage)} | {r.median_ms:.1f} | "
                    f"{min(r.timed_ms):.1f}–{max(r.timed_ms):.1f} | {lo:.1f}–{hi:.1f} | {r.tokens_per_s:,.0f} | "
                    f"{_fmt(r.reserved_gib, '{:.2f}')} | {_fmt(r.peak_gib, '{:.2f}')} | {ratio} | {memory} | {busy} | "
                    f"{'' if r.delayed_ops is None else r.delayed_ops} |")
    return rows


def _rounds(results: list[LineResult], scenario: str) -> list[str]:
    """With --rounds: each round's median per line and its ratio to the bar line *of the same round*.
    On a drifting host (these VMs' step times wander by 20% between minutes) a paired, per-round
    ratio is steadier than the ratio of pooled medians; the summary gives both."""
    bar = best_megatron(results, scenario)
    ok = [r for r in results if r.ok and r.scenario == scenario and len(r.round_medians) > 1]
    if bar is None or not any(r is bar for r in ok):
        return []
    rounds = len(bar.round_medians)
    rows = ["Per round (lines interleaved within each round; ratio = the bar line's median in that round / "
            "this line's):", "", "| round | " + " | ".join(r.name for r in ok) + " |", "|---" * (len(ok) + 1) + "|"]
    for i in range(rounds):
        cells = []
        for r in ok:
            if i >= len(r.round_medians):
                cells.append("")
                continue
            ratio = bar.round_medians[i] / r.round_medians[i]
            cells.append(f"{r.round_medians[i]:.1f}" + ("" if r is bar else f" ({ratio:.3f}x)"))
        rows.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    for r in ok:
        if r is bar:
            continue
        ratios = [b / x for b, x in zip(bar.round_medians, r.round_medians, strict=False)]
        rows.append("")
        rows.append(f"- **{r.name}** vs {bar.name}: per-round ratios {min(ratios):.3f}–{max(ratios):.3f}x, "
                    f"median {statistics.median(ratios):.3f}x (pooled medians: {bar.median_ms / r.median_ms:.3f}x).")
    return rows + [""]


MEMORY_BOUND = 1.10
"""A DPP line counts against megatron's best only at <= 1.10x its peak reserved memory (the benchmark's bound)."""
GOALS = {"a": 1.05, "c": 1.10}
"""The benchmark's speed goals per scenario (best DPP line / best megatron 1F1B line); other scenarios: none."""


def _vp(name: str) -> int:
    entry = line_entry(name)
    return entry[1] if entry else 1


def _verdict(results: list[LineResult], scenario: str) -> list[str]:
    """The fastest DPP line within the memory bound against the bar, at v=1 (against the best megatron
    line) and at v=2 (against megatron's interleaved line), with the goal it is held to."""
    ok = [r for r in results if r.ok and r.scenario == scenario]
    out = []
    for vp, bars in ((1, [r for r in ok if r.name in MEGATRON_LINES and _vp(r.name) == 1]),
                     (2, [r for r in ok if r.name == "megatron-interleaved-v2"])):
        bar = min(bars, key=lambda r: r.median_ms, default=None)
        dpp = [r for r in ok if _is_dynamic(r.name) and _vp(r.name) == vp]
        if bar is None or not dpp:
            continue
        fits = [r for r in dpp if r.reserved_gib and bar.reserved_gib and r.reserved_gib <= MEMORY_BOUND * bar.reserved_gib]
        goal = GOALS.get(scenario)
        if not fits:
            out.append(f"- v={vp}: no DPP line within {MEMORY_BOUND:.2f}x {bar.name}'s peak reserved memory"
                       + (" (memory not measured on this device)" if not bar.reserved_gib else "") + ".")
            continue
        best = min(fits, key=lambda r: r.median_ms)
        ratio = bar.median_ms / best.median_ms
        paired = [b / x for b, x in zip(bar.round_medians, best.round_medians, strict=False)]
        spread = f", per round {min(paired):.3f}–{max(paired):.3f}x" if len(paired) > 1 else ""
        verdict = "" if goal is None or vp > 1 else (f" — goal >= {goal:.2f}x: **{'met' if ratio >= goal else 'missed'}**")
        out.append(f"- v={vp}: fastest DPP line within {MEMORY_BOUND:.2f}x {bar.name}'s memory: **{best.name}**, "
                   f"{ratio:.3f}x{spread} at {best.reserved_gib / bar.reserved_gib:.3f}x the memory{verdict}.")
    return out + [""] if out else []


def _is_dynamic(name: str) -> bool:
    """A line of the dynamic policies (dpp, dpp-zb), not a megatron or static-order bar."""
    return name not in MEGATRON_LINES and name != "direct-megatron" and base_name(name) not in STATIC_LINES


def balanced_limit_ms(result: LineResult) -> float | None:
    """The step's physical floor if its GPU work were spread evenly: sum of per-stage busy / PP."""
    if not result.busy_ms:
        return None
    return sum(result.busy_ms.values()) / len(result.busy_ms)


def slowest_busy(result: LineResult) -> tuple[int, float] | None:
    """(stage, its busy ms per iteration) of the line's busiest stage: no order of the same kernels runs a
    step shorter than the time that stage's GPU is busy (None: no per-stage busy time measured)."""
    if not result.busy_ms:
        return None
    stage = max(result.busy_ms, key=lambda s: result.busy_ms[s])
    return stage, result.busy_ms[stage]


def best_static(results: list[LineResult], scenario: str) -> tuple[LineResult | None, bool]:
    """(fastest graphed static-order line, True) -- the runtime's graphed orders and megatron-core's schedule
    with its own graphs alike --, else (fastest eager static-order line, False)."""
    ok = [r for r in results if r.ok and r.scenario == scenario]
    for names, graphed in ((STATIC_GRAPHED_LINES + MEGATRON_GRAPHED_LINES, True), (STATIC_EAGER_LINES, False)):
        candidates = [r for r in ok if base_name(r.name) in names]
        if candidates:
            return min(candidates, key=lambda r: r.median_ms), graphed
    return None, False


def headline_pick(results: list[LineResult], scenario: str) -> tuple[LineResult | None, LineResult | None, bool]:
    """(the headline's DPP line, megatron-core's best eager line, whether the former fits within MEMORY_BOUND
    of the latter's memory): the fastest dynamic line that fits, else the fastest dynamic line."""
    dynamic = [r for r in results if r.ok and r.scenario == scenario and _is_dynamic(r.name)]
    bar = best_megatron(results, scenario, eager_only=True)
    fits = [r for r in dynamic if bar and r.reserved_gib and bar.reserved_gib
            and r.reserved_gib <= MEMORY_BOUND * bar.reserved_gib]
    best = min(fits or dynamic, key=lambda r: r.median_ms, default=None)
    return best, bar, bool(fits)


def headline(results: list[LineResult], scenario: str) -> list[str]:
    """Three ratios for the scenario's fastest DPP line (within MEMORY_BOUND of megatron's best where one
    fits): vs megatron-core's best eager line (graphs + schedule), vs the best graphed static order in the
    same runtime (what the dynamic schedule alone buys), and its step vs the balanced limit (how far from
    the GPU work spread evenly; sum of per-stage GPU busy / PP)."""
    ok = [r for r in results if r.ok and r.scenario == scenario]
    best, bar, fits = headline_pick(results, scenario)
    if best is None:
        return []
    why = (f"fastest within {MEMORY_BOUND:.2f}x {bar.name}'s peak reserved" if fits
           else "fastest DPP line" + (" (memory not compared)" if not (bar and bar.reserved_gib) else
                                      f" (none within {MEMORY_BOUND:.2f}x the memory)"))
    out = [f"**Headline** — **{best.name}** ({why}), {best.median_ms:.1f} ms/iter:"]

    def memory(of: LineResult, against: LineResult) -> str:
        if of.reserved_gib and against.reserved_gib:
            return f", at {of.reserved_gib / against.reserved_gib:.3f}x its peak reserved"
        return ""

    if bar is not None:
        out.append(f"1. vs megatron-core's best eager line ({bar.name}, {bar.median_ms:.1f} ms): "
                   f"**{bar.median_ms / best.median_ms:.3f}x**{memory(best, bar)}.")
    else:
        out.append("1. vs megatron-core's best eager line: n/a (no megatron line ran in this scenario).")
    static, graphed = best_static(results, scenario)
    if static is not None:
        kind = "graphed static" if graphed else "static (eager: no graphed static line ran, e.g. on CPU)"
        where = ("megatron-core's schedule with its own graphs" if static.name in MEGATRON_GRAPHED_LINES
                 else "in the same runtime")
        out.append(f"2. vs the best {kind} order {where} ({static.name}, {static.median_ms:.1f} ms): "
                   f"**{static.median_ms / best.median_ms:.3f}x**{memory(best, static)} — what the dynamic "
                   "schedule buys over a fixed order with the same kernels and launches.")
    else:
        out.append("2. vs the best graphed static line: n/a (add 1f1b-graphs, interleaved-graphs, zb-h1-graphs or "
                   "megatron-1f1b-graphs).")
    limit = balanced_limit_ms(best)
    if limit:
        source = "" if best.busy_source.startswith("GPU") or not best.busy_source else f" ({best.busy_source})"
        out.append(f"3. step vs its balanced limit (sum of per-stage busy / PP = {limit:.1f} ms{source}): "
                   f"**{best.median_ms / limit:.3f}x**" + (
                       f"; the static bar's: {static.median_ms / balanced_limit_ms(static):.3f}x"
                       if static is not None and balanced_limit_ms(static) else "") + ".")
    else:
        out.append("3. step vs the balanced limit: n/a (no per-stage busy time measured).")
    floor = slowest_busy(best)
    if floor:
        static_floor = slowest_busy(static) if static is not None else None
        out.append(f"   Step vs its slowest stage's busy (stage {floor[0]}, {floor[1]:.1f} ms: no order of the same "
                   f"kernels runs faster): {best.median_ms / floor[1]:.3f}x" + (
                       f"; the static bar's: {static.median_ms / static_floor[1]:.3f}x (the most a better order "
                       "could gain over it)" if static_floor else "") + ".")
    out += _v2_against_interleaved(ok)
    return out + [""]


def _v2_against_interleaved(ok: list[LineResult]) -> list[str]:
    """v=2: the fastest dynamic v=2 line within MEMORY_BOUND of the graphed interleaved order's memory."""
    bars = [r for r in ok if base_name(r.name) == "interleaved-graphs"]
    dynamic = [r for r in ok if _is_dynamic(r.name) and _vp(r.name) == 2]
    if not bars or not dynamic:
        return []
    bar = min(bars, key=lambda r: r.median_ms)
    fits = [r for r in dynamic if r.reserved_gib and bar.reserved_gib and r.reserved_gib <= MEMORY_BOUND * bar.reserved_gib]
    if not fits:
        return [f"- v=2: no dynamic v=2 line within {MEMORY_BOUND:.2f}x {bar.name}'s peak reserved memory."]
    best = min(fits, key=lambda r: r.median_ms)
    floor = slowest_busy(bar)
    room = (f" ({bar.name}'s step is {bar.median_ms / floor[1]:.3f}x its slowest stage's busy: the most a better "
            "order could gain over it)") if floor else ""
    return [f"- v=2: **{best.name}** vs {bar.name}: **{bar.median_ms / best.median_ms:.3f}x** at "
            f"{best.reserved_gib / bar.reserved_gib:.3f}x its peak reserved{room}."]


def _balance(results: list[LineResult], scenario: str, cfg: BenchConfig) -> list[str]:
    """Each line's stage balance, fitted to its GPU busy per stage and iteration
    (trainer/schedule/stage_balance.py): a persistent slow stage, and the layer split that would fix it."""
    from trainer.schedule.stage_balance import describe, stage_balance

    out = []
    for r in (r for r in results if r.ok and r.scenario == scenario):
        rows = r.busy_rows or ([list(r.busy_ms.values())] if r.busy_ms else [])
        if len(r.layers_per_stage) < 2 or not rows or len(rows[0]) != len(r.layers_per_stage):
            continue
        try:
            # A split in half layers (--pipeline-stage-layers) is fitted with what the attention half costs.
            halves = any(not float(n).is_integer() for n in r.layers_per_stage)
            share = layer_attention_share(cfg)[0] if halves else None
            balance = stage_balance(rows, r.layers_per_stage, _vp(r.name), share)
        except ValueError as err:
            text = f"not fitted: {err}"
        else:
            text = describe(balance)
            if balance.recommend:  # the same layout as this command's flag (both ends given: middle even)
                flag = "--split" if _vp(r.name) == 1 else "--split-vp"
                text += f" (this benchmark: `{flag} {balance.best.layers[0]},{balance.best.layers[-1]}`)"
        out.append(f"- **{r.name}**: " + text.removeprefix("stage balance: ").replace("\n  ", "; "))
    if not out:
        return []
    return (["Stage balance (a cost model fitted to each line's busy time per stage -- GPU kernels per profiled "
             "iteration on CUDA, traced host spans on CPU; the re-split is a prediction a new run must confirm):",
             ""] + out + [""])


def _losses(results: list[LineResult], scenario: str) -> list[str]:
    ok = [r for r in results if r.ok and r.scenario == scenario and r.losses]
    if not ok:
        return []
    rows = ["| iteration | " + " | ".join(r.name for r in ok) + " |", "|---" * (len(ok) + 1) + "|"]
    for i in range(min(LOSS_ITERATIONS, max(len(r.losses) for r in ok))):
        cells = [f"{r.losses[i]:.5f}" if i < len(r.losses) else "" for r in ok]
        rows.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return rows


def _variable_length_note(cfg: BenchConfig) -> list[str]:
    real, padded = variable_length_tokens(cfg)
    full = cfg.global_batch_size * cfg.seq_length
    return [f"`{' '.join(variable_length_args(cfg))}` for every line: one mock document per sample, "
            f"lengths {cfg.seq_len_dist} (mean-one log-normal ratio x seq/2, seeded by sample index), each "
            f"microbatch cut to its longest document rounded up to {cfg.seq_length_divisible_by} (at most "
            f"{cfg.seq_length}); megatron-core lines run with variable_seq_lengths=True (a shape exchange "
            f"before each P2P transfer), GPT's loss averaged per token. Per iteration, on average, "
            f"{real:,.0f} real tokens ({real / full:.0%} of batch x seq) and {padded:,.0f} after bucketing "
            f"({padded / full:.0%}); tokens/s counts real tokens.", ""]


def _corpus_note(cfg: BenchConfig) -> list[str]:
    real, padded = variable_length_tokens(cfg, "d")
    full = cfg.global_batch_size * cfg.seq_length
    return [f"`--data-path {cfg.corpus} --variable-seq-lengths --seq-length-divisible-by "
            f"{cfg.seq_length_divisible_by}` for every line: one document (or piece of a long one, at most "
            f"{cfg.seq_length} tokens) of the corpus per sample, in the trainer's seeded order, each microbatch "
            f"cut to its longest sample rounded up to {cfg.seq_length_divisible_by}; megatron-core lines run with "
            f"variable_seq_lengths=True, GPT's loss averaged per token. Per iteration, on average, {real:,.0f} "
            f"real tokens ({real / full:.0%} of batch x seq) and {padded:,.0f} after bucketing ({padded / full:.0%}); "
            "tokens/s counts real tokens.", ""]


def model_text(cfg: BenchConfig) -> str:
    """The model of ``cfg`` in words (the report's "Model:" lines)."""
    kind = {"gpt": "GPT", "bert": "BERT"}.get(cfg.model, cfg.model)
    return (f"{kind} {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, seq "
            f"{cfg.seq_length}, vocab {cfg.vocab_size} (mock data), mbs {cfg.micro_batch_size}, M={cfg.num_microbatches}"
            + (f", `{' '.join(cfg.model_flags)}`" if cfg.model_flags else ""))


def write_report(path: Path, cfg: BenchConfig, results: list[LineResult], not_run: list[NotRun],
                 commands: dict[str, str], pictures: dict[str, str], wall_s: float, host: str = "",
                 layouts: dict[str, str] | None = None, notes: list[str] = (),
                 configs: dict[str, BenchConfig] | None = None) -> None:
    """``host``: the launch probe's line (trainer.bench.launch_probe), printed under the card.
    ``layouts``: line key -> layout label (``--layouts``): one section, and tables, per layout.
    ``notes``: which layer split the lines ran and why (``--resplit auto``).
    ``configs``: layout label -> its configuration; each layout's section names its model (a layout may
    name its own, ``4x1x1@bert16-h2048``), and the header's "Model:" says "per layout" where they differ."""
    versions = next((r.versions for r in results if r.versions), {})
    configs = configs or {}
    models = {model_text(c) for c in configs.values()} or {model_text(cfg)}
    model_line = (f"Model: {models.pop()}" if len(models) == 1 else "Model: per layout (each layout's section names it)")
    iterations = {c.train_iters for c in configs.values()} or {cfg.train_iters}
    lines = [
        "# Pipeline benchmark", "",
        f"Written by `python -m trainer.bench.pipeline` in {wall_s:.0f} s. Card: **{versions.get('device_name', '?')}**"
        f" × {cfg.pipeline_parallel} ({cfg.device}); torch {versions.get('torch', '?')}, megatron-core "
        f"{versions.get('megatron_core', '?')}, NCCL {versions.get('nccl', 'n/a')}, CUDA {versions.get('cuda', 'n/a')}, "
        f"Python {versions.get('python', '?')}." + (f" Host: {host}." if host else ""), "",
        f"{model_line}, PP={cfg.pipeline_parallel}, {'bf16' if cfg.bf16 else 'fp32'}, optimizer {cfg.optimizer}, "
        f"dropout 0, {'/'.join(map(str, sorted(iterations)))} iterations per line, CPU binding {cfg.cpu_bind}. "
        f"Timings: iterations {cfg.skip_iters + 1}+"
        + (f" except the last {cfg.gpu_busy_iters} (run under the kernel profiler for the GPU busy column)"
           if cfg.device == "cuda" and cfg.gpu_busy_iters else "") + "; per iteration the "
        "slowest rank's host step time (the step ends with the loss all-reduce, which waits for the GPU). "
        "Ratio = best megatron line's median / this line's median (above 1 = faster).", "",
        "GPU busy: union of the non-NCCL kernels each rank ran per iteration, from torch.profiler (CUPTI) — "
        "measured on the GPU, for megatron-core's schedules and ours alike. Timelines: on CUDA every line's "
        "picture shows those kernels per stage (our span tracer does not see megatron-core's schedules, the "
        "kernel trace sees every schedule); on CPU, our runtime's traced F/B spans.", "",
    ]
    if notes:
        lines += ["## Layer split (--resplit auto)", ""] + [f"- {n}" for n in notes] + [""]
    layouts = layouts or {}
    labels = list(dict.fromkeys(layouts.values())) or [""]
    for label in labels:
        subset = [r for r in results if layouts.get(r.key, "") == label]
        own = configs.get(label, cfg)
        if label:
            lines += [f"## Layout {label}", ""]
        if label in configs:
            name = f"**{own.layout.model}**: " if own.layout is not None and own.layout.model else ""
            lines += [f"Model: {name}{model_text(own)}, {'bf16' if own.bf16 else 'fp32'}, {own.train_iters} "
                      f"iterations; {own.layout.describe() if own.layout is not None else ''}.", ""]
        lines += _scenario_sections(subset, own, pictures, "###" if label else "##")
    if not_run:
        lines += ["## Lines not run", ""] + [f"- ({n.scenario}) **{n.name}**" + (f" [{n.layout}]" if n.layout else "")
                                             + f": {n.reason}" for n in not_run] + [""]
    lines += ["## Commands", "", "Every line's ranks ran:", ""]
    lines += [f"- `{key}`: `{command}`" for key, command in commands.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _scenario_sections(results: list[LineResult], cfg: BenchConfig, pictures: dict[str, str],
                       level: str) -> list[str]:
    lines: list[str] = []
    for scenario, title in SCENARIOS.items():
        lines += [f"{level} ({scenario}) {title}", ""]
        if not any(r.scenario == scenario for r in results):
            lines += ["not run in this call.", ""]
            continue
        if scenario == "b":
            lines += _variable_length_note(cfg)
        if scenario == "d":
            lines += _corpus_note(cfg)
        if scenario == "c":
            lines += [f"`--inject-stalls {cfg.stall}` (RANK:FRACTION:MS:SEED) for every line: the same forward "
                      "ops of that rank delayed (a GPU spin kernel on CUDA); backwards are not delayed.", ""]
        lines += headline(results, scenario)
        lines += _table(results, scenario) + [""]
        lines += _verdict(results, scenario)
        lines += _rounds(results, scenario)
        lines += _balance(results, scenario, cfg)
        best, _, _ = headline_pick(results, scenario)
        static, _ = best_static(results, scenario)
        if best is not None and static is not None:
            lines += kernel_differences(best, static)
        losses = _losses(results, scenario)
        if losses:
            lines += ["Losses of the first iterations (last stage):", ""] + losses + [""]
        for r in (r for r in results if r.scenario == scenario):
            picture = pictures.get(r.key)
            lines.append(f"- **{r.name}**: {r.label}." + (f" ![{r.key}]({picture})" if picture else "")
                         + ("" if r.ok else f" **{r.status}**"))
        lines.append("")
    return lines


def _kernel_rows(documents: list[dict[str, Any]]) -> tuple[list[tuple[str, list, list]], float]:
    """(row name, compute intervals, nccl intervals) per rank on a common origin (µs), and the origin."""
    timelines = [(d["stage"], d["rank"], (d.get("gpu_busy") or {}).get("timeline") or {}) for d in documents]
    timelines = [t for t in timelines if t[2]]
    if not timelines:
        return [], 0.0
    origin = min(t[2]["step_start_us"] for t in timelines)
    rows = [(f"stage {stage} (rank {rank})", t["compute"], t["nccl"]) for stage, rank, t in sorted(timelines)]
    return rows, origin


def plot_kernel_timeline(result: LineResult, path: Path) -> bool:
    """One profiled iteration's GPU kernels per stage (busy blue, NCCL grey); False if none recorded."""
    rows, origin = _kernel_rows(result.metrics)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(16, 0.6 * len(rows) + 1.2))
    for y, (_name, compute, nccl) in enumerate(rows):
        ax.broken_barh([((a - origin) / 1e3, (b - a) / 1e3) for a, b in nccl], (y - 0.1, 0.2), color="#999999")
        ax.broken_barh([((a - origin) / 1e3, (b - a) / 1e3) for a, b in compute], (y - 0.35, 0.7), color="#4C72B0")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the earliest rank's step start")
    ax.set_title(f"{result.key}: GPU kernels of one iteration (blue: compute, grey: NCCL)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_trace_timeline(trace_dir: Path, path: Path) -> bool:
    """Our runtime's traced F/B spans (trainer.profiling), last iteration; False when not traced."""
    if not trace_dir.is_dir():
        return False
    from trainer.profiling.loading import load_rank_traces
    from trainer.profiling.merge import merge_traces
    from trainer.profiling.plot import plot_timeline
    from trainer.profiling.summary import iterations_of

    run = load_rank_traces(trace_dir)
    if not run.traces:
        return False
    merged = merge_traces(run.traces, run.missing_ranks, run.problems)
    traced = iterations_of(merged)
    if not traced:
        return False
    plot_timeline(merged, path, traced[-1])
    return True
