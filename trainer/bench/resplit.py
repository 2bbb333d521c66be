"""``--resplit auto``: a short profiling round picks the layer split the stage-balance fit recommends.

Why: the fit (trainer/schedule/stage_balance.py) names a persistently slow stage and the Megatron
split that would fix it, but applying it took a second call by hand. Here one line per chunk count
(v=1, v=2) of the call runs a few iterations on the split the benchmark would use, its per-stage GPU
busy (host spans on CPU) is fitted, and where the fit recommends a re-split every line of that chunk
count runs on it. The report says, per chunk count, which split the lines ran and why (the fit's
figures, or why the split stayed).

The lines may also run a split in half layers (``--pipeline-stage-layers``, a stage boundary between a
layer's attention and its MLP; trainer/schedule/half_split.py): where the fit's model, with the attention
half's share of a layer measured on the GPU (else from the model's FLOPs, or ``--attention-share``), puts
that split's slowest stage at least :data:`~trainer.schedule.stage_balance.MIN_GAIN` below the best split
Megatron's first/last flags express. v=1 lines get one count per stage, v=2 lines one per virtual stage
(``balanced_chunk_split``: with whole layers megatron-core gives both chunks of a stage the same count, so
the last stage keeps the head on top of its share).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.bench.lines import BenchConfig, Line, layer_attention_share, line_entry, plan, stage_layers_field
from trainer.bench.results import LineResult
from trainer.schedule.stage_parts import describe as describe_counts

if TYPE_CHECKING:
    from trainer.schedule.stage_balance import StageBalance

PROFILE_ITERS = 3
"""Timed iterations of the profiling round beyond the warm-up and the profiled ones (only the
profiled iterations' busy time is fitted; the rest lets the step settle)."""


@dataclass(frozen=True)
class SplitChoice:
    """The split the lines of one chunk count ran, and why."""

    vp: int
    split: tuple[int, int] | None
    """(first, last) stage layers; None = the even split (or ``stage_layers``)."""
    reason: str
    stage_layers: str = ""
    """--pipeline-stage-layers of the lines (every stage's count, e.g. 4.5,4.5,4.5,2.5); "": ``split``."""

    def note(self) -> str:
        if self.stage_layers:
            where = f"--pipeline-stage-layers {self.stage_layers}"
        elif self.split is None:
            where = "even split"
        else:
            where = f"--decoder-first/last-pipeline-num-layers {self.split[0]}/{self.split[1]}"
        return f"- v={self.vp} lines ran the {where}: {self.reason}"


def profiling_lines(names: list[str], vp: int) -> list[str]:
    """Candidates for the short round fitted for chunk count ``vp``, in order: the listed lines of that
    count that run on the balanced split (any schedule's GPU busy per stage measures the same layers);
    the first one that can run here is used."""
    return [name for name in names if (entry := line_entry(name)) is not None and entry[1] == vp and entry[3]
            and name != "direct-megatron"]


def choose_splits(cfg: BenchConfig, names: list[str], available_policies: tuple[str, ...],
                  run: Callable[[Line, BenchConfig], LineResult]) -> tuple[BenchConfig, list[SplitChoice]]:
    """Run the profiling round(s) with ``run`` and return the configuration the lines then run with
    (``split`` / ``split_vp`` set where the fit recommends a re-split) and what was chosen per chunk count."""
    from trainer.schedule.stage_balance import describe, stage_balance

    short = dataclasses.replace(cfg, train_iters=cfg.skip_iters + PROFILE_ITERS + cfg.gpu_busy_iters)
    choices: list[SplitChoice] = []
    for vp in sorted({line_entry(n)[1] for n in names if line_entry(n) is not None}):
        candidates = profiling_lines(names, vp)
        field = "split" if vp == 1 else "split_vp"
        given = getattr(cfg, field)
        layers_field = stage_layers_field(vp)
        if getattr(cfg, layers_field):
            choices.append(SplitChoice(vp, None, f"given (--{layers_field.replace('_', '-')}); no profiling round",
                                       getattr(cfg, layers_field)))
            continue
        if given is not None:
            choices.append(SplitChoice(vp, given, f"given (--{field.replace('_', '-')}); no profiling round"))
            continue
        if not candidates:
            continue
        planned = [p for p in plan(short, candidates, ["a"], available_policies) if isinstance(p, Line)]
        if not planned:
            choices.append(SplitChoice(vp, None, f"none of {', '.join(candidates)} can run here; balanced split kept"))
            continue
        name = planned[0].name
        line = dataclasses.replace(planned[0], name=f"resplit-{name}")
        result = run(line, short)
        start = planned[0].split
        if not result.ok:
            choices.append(SplitChoice(vp, start, f"the profiling round ({name}) failed: kept the balanced split"))
            continue
        rows = result.busy_rows or ([list(result.busy_ms.values())] if result.busy_ms else [])
        try:
            balance = stage_balance(rows, result.layers_per_stage, vp)
        except ValueError as err:
            choices.append(SplitChoice(vp, start, f"the profiling round ({name}) could not be fitted ({err}): "
                                                  "kept the balanced split"))
            continue
        fitted = describe(balance).removeprefix("stage balance: ").replace("\n  ", "; ")
        source = f"profiling round of {name}, {short.train_iters} iterations, busy from {result.busy_source}"
        finer = _finer_split(balance, cfg, source, fitted, vp)
        if finer is not None:
            cfg = dataclasses.replace(cfg, **{layers_field: finer.stage_layers})
            choices.append(finer)
        elif balance.recommend:
            layers = balance.best.layers
            split = (layers[0], layers[-1])
            cfg = dataclasses.replace(cfg, **{field: split})
            choices.append(SplitChoice(vp, split, f"the stage-balance fit's re-split of "
                                                  f"{describe_counts(balance.layers)} ({source}): {fitted}"))
        else:
            choices.append(SplitChoice(vp, start, f"the fit recommends no re-split ({source}): {fitted}"))
    return cfg, choices


def _finer_split(balance: StageBalance, cfg: BenchConfig, source: str, fitted: str, vp: int) -> SplitChoice | None:
    """The lines' split in half layers -- per stage at v=1 (or in whole layers Megatron's flags cannot lay
    out), per virtual stage at v > 1 -- where the fit predicts its slowest stage at least MIN_GAIN below both
    the best Megatron split's and the run's; else None."""
    from trainer.schedule.half_split import balanced_chunk_split, balanced_half_split
    from trainer.schedule.stage_balance import MIN_GAIN
    from trainer.schedule.stage_parts import splits_inside_layers

    if not balance.persistent:  # the stages measured alike: a finer split would chase noise
        return None
    share, how = layer_attention_share(cfg)
    costs = dataclasses.replace(balance.costs, attention_share=share)
    if vp == 1:
        finer = balanced_half_split(costs, len(balance.layers))
        if finer.megatron:
            return None
    else:
        finer = balanced_chunk_split(costs, len(balance.layers), vp)
    whole = balance.best
    bar = min(whole.bottleneck, balance.current.bottleneck) * (1 - MIN_GAIN)
    if finer.bottleneck > bar:
        return None
    counts = finer.trainer_flags()[1]
    kind = ("in half layers per virtual stage" if vp > 1 else "in half layers" if splits_inside_layers(finer.layers)
            else "in whole layers, beyond Megatron's flags")
    reason = (f"the stage-balance fit's re-split of {describe_counts(balance.layers)} {kind} ({source}): slowest "
              f"stage {finer.bottleneck:.1f} ms predicted against {whole.bottleneck:.1f} ms for the best split "
              f"Megatron's first/last flags express ({describe_counts(whole.layers)}; "
              f"{finer.bottleneck / whole.bottleneck - 1:+.0%}), the attention half taken as {share:.3f} of a "
              f"layer ({how}); the fit: {fitted}")
    return SplitChoice(vp, None, reason, counts)
