"""Is one pipeline stage persistently the slowest, and which layer split would fix it -- from what a
run measured.

Input: each stage's compute time per iteration (GPU time of its ops from a trace, or its kernels'
busy time from ``--metrics-dir``; host time on CPU, where ops are synchronous) and the layer split
the run had. The model behind the fit is :class:`~trainer.schedule.layers.LayerCosts`: a stage
costs ``speed * (layers * layer + embedding [first stage] + head [last stage])``. With three or
more stages the middle ones give the per-layer time (their median), the first and last stages'
surplus over it gives the embedding and the head, and a middle stage slower per layer than the
median is a slower GPU (``stage_speed``); with two stages the embedding is taken as free (nothing
separates it from stage 0's layers). The fitted model reproduces every measured stage time, so the
split it prefers (:func:`~trainer.schedule.layers.balanced_split`) is a prediction from the run's
own figures -- a new run must confirm it.

A run split with ``--pipeline-stage-layers`` may hold half layers (4.5): the fit takes a half as
half a layer's time. That is an approximation -- a layer's attention and its MLP cost differently
(the MLP's GEMMs are about twice the attention's projections at the usual 4x hidden, and attention's
cost grows with the sequence) -- so per-layer time and the splits fitted from a half-layer run are
rougher than from a whole-layer one; the splits it recommends are whole layers.

Pure: the trace aggregation (trainer.profiling.aggregate) and the benchmark report both call it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.schedule.layers import LayerCosts, LayerSplit, balanced_split, half_counts, split_of
from trainer.schedule.stage_parts import describe as describe_counts
from trainer.schedule.stage_parts import layer_count

PERSISTENT_SHARE = 0.75
"""A stage is *persistently* the slowest when it is the slowest in at least this share of the
iterations measured (or, given means only, when its mean is the largest)."""
MIN_EXCESS = 0.05
"""...and its time exceeds the mean of the other stages by at least this much; below that the
stages count as balanced (a measurement's noise, not a layer too many)."""
MIN_GAIN = 0.02
"""A re-split is recommended only where it makes the slowest stage faster by at least this much."""


@dataclass(frozen=True)
class StageBalance:
    """One run's stage times, the cost model fitted to them and the splits it prefers."""

    stage_ms: tuple[float, ...]
    """Mean compute time per iteration of each stage."""
    layers: tuple[float, ...]
    """The run's transformer layers per stage (x.5: a stage boundary inside a layer)."""
    slowest: int
    """The stage with the largest mean time."""
    slowest_share: float | None
    """Share of the iterations in which ``slowest`` was the slowest stage (None: means only)."""
    iterations: int
    """How many iterations the times are from (0: means only)."""
    costs: LayerCosts
    """The fitted model (ms): per-layer, embedding, head time and per-stage speed."""
    fit: str
    """How the model was fitted (what it had to assume)."""
    current: LayerSplit
    """The run's split under the fitted model (its stage costs are the measured times)."""
    best: LayerSplit
    """The split Megatron-LM's first/last-stage flags can express whose slowest stage is fastest."""
    free: LayerSplit
    """The same without Megatron's constraint (middle stages even): any count per stage."""

    @property
    def excess(self) -> float:
        """How much slower the slowest stage is than the mean of the others (0.2 = 20%)."""
        others = [ms for s, ms in enumerate(self.stage_ms) if s != self.slowest]
        mean = statistics.fmean(others) if others else self.stage_ms[self.slowest]
        return self.stage_ms[self.slowest] / mean - 1.0 if mean > 0 else 0.0

    @property
    def persistent(self) -> bool:
        share_ok = self.slowest_share is None or self.slowest_share >= PERSISTENT_SHARE
        return share_ok and self.excess >= MIN_EXCESS

    @property
    def gain(self) -> float:
        """1 - the best split's slowest stage / the run's slowest stage (predicted)."""
        return 1.0 - self.best.bottleneck / self.current.bottleneck

    @property
    def recommend(self) -> bool:
        return self.persistent and self.gain >= MIN_GAIN and self.best.layers != self.layers

    def to_dict(self) -> dict:
        return {"stage_ms": [round(ms, 3) for ms in self.stage_ms], "layers": list(self.layers),
                "slowest": self.slowest, "slowest_share": self.slowest_share, "iterations": self.iterations,
                "excess": round(self.excess, 4), "persistent": self.persistent, "fit": self.fit,
                "layer_ms": round(self.costs.layer, 3), "embedding_ms": round(self.costs.embedding, 3),
                "head_ms": round(self.costs.head, 3), "stage_speed": [round(x, 3) for x in self.costs.stage_speed],
                "best": _split_dict(self.best), "free": _split_dict(self.free),
                "gain": round(self.gain, 4), "recommend": self.recommend}


def _split_dict(split: LayerSplit) -> dict:
    return {"layers": list(split.layers), "stage_ms": [round(c, 3) for c in split.stage_costs],
            "flags": split.flags() if split.megatron else None}


def fit_layer_costs(stage_ms: Sequence[float], layers: Sequence[float],
                    attention_share: float | None = None) -> tuple[LayerCosts, str]:
    """The :class:`LayerCosts` (in ms) that reproduce ``stage_ms`` for the split ``layers``, and a
    line saying what the fit assumed. ValueError for fewer than two stages or a stage without
    layers or time. ``attention_share``: the attention half's share of a layer, for a split in half
    layers (None there: taken as half, and the fit says so)."""
    p = len(layers)
    if p < 2 or len(stage_ms) != p:
        raise ValueError(f"need one time per stage for two or more stages (times {list(stage_ms)}, layers {list(layers)})")
    bad = [s for s in range(p) if layers[s] <= 0 or not (math.isfinite(stage_ms[s]) and stage_ms[s] > 0)]
    if bad:
        raise ValueError(f"stages {bad} have no layers or no positive time (times {list(stage_ms)}, layers {list(layers)})")
    if not float(sum(layers)).is_integer():
        raise ValueError(f"the layers per stage {describe_counts(layers)} add up to {layer_count(sum(layers))}, "
                         "not a whole number of layers")
    halves = half_counts(layers)
    inside = any(a != m for a, m in halves)
    share = attention_share if attention_share is not None or not inside else 0.5
    # Each stage's layer work in layers: a split layer's attention half is `share` of a layer, not half.
    work = [a if a == m else a * share + m * (1.0 - share) for a, m in halves]
    if p >= 3:
        # The lower median: with two middle stages and one of them on a slower GPU, the mean of the
        # two would call both GPUs off-speed; the faster one is the per-layer time.
        layer = statistics.median_low(stage_ms[s] / work[s] for s in range(1, p - 1))
        fit = f"per-layer time = lower median of the {p - 2} middle stage(s)"
    else:
        layer = stage_ms[0] / work[0]
        fit = "two stages: the embedding is taken as free (per-layer time = stage 0's)"
    embedding = max(stage_ms[0] - work[0] * layer, 0.0)
    head = max(stage_ms[-1] - work[-1] * layer, 0.0)
    extras = [embedding] + [0.0] * (p - 2) + [head]
    speed = tuple(stage_ms[s] / (work[s] * layer + extras[s]) for s in range(p))
    if all(abs(x - 1.0) <= 1e-6 for x in speed):
        speed = ()
    slower = [s for s in range(p) if speed and speed[s] > 1.0 + MIN_EXCESS]
    if slower:
        fit += f"; stage(s) {slower} slower per layer than that (a slower device?)"
    if inside:
        fit += (f"; the attention half taken as {share:.3f} of a layer"
                + (" (no share given: half)" if attention_share is None else ""))
    return LayerCosts(num_layers=sum(a + m for a, m in halves) // 2, layer=layer, embedding=embedding, head=head,
                      stage_speed=speed, attention_share=share), fit


def stage_balance(per_iteration: Sequence[Sequence[float]], layers: Sequence[float],
                  num_chunks: int = 1, attention_share: float | None = None) -> StageBalance:
    """The balance of a run from its stage times: ``per_iteration[i][s]`` is stage ``s``'s compute
    in iteration ``i`` (one row: means only). ValueError where nothing can be fitted.
    ``attention_share``: the attention half's share of a layer (used for a split in half layers)."""
    rows = [tuple(float(x) for x in row) for row in per_iteration]
    if not rows:
        raise ValueError("no stage times to fit")
    p = len(layers)
    if any(len(row) != p for row in rows):
        raise ValueError(f"every iteration needs one time per stage ({p} stages: layers {list(layers)})")
    means = tuple(statistics.fmean(row[s] for row in rows) for s in range(p))
    slowest = max(range(p), key=lambda s: means[s])
    share = (sum(max(range(p), key=lambda s: row[s]) == slowest for row in rows) / len(rows)
             if len(rows) > 1 else None)
    costs, fit = fit_layer_costs(means, layers, attention_share)
    return StageBalance(
        stage_ms=means, layers=tuple(map(layer_count, layers)), slowest=slowest, slowest_share=share,
        iterations=len(rows) if len(rows) > 1 else 0, costs=costs, fit=fit,
        current=split_of(costs, layers, num_chunks), best=balanced_split(costs, p, num_chunks),
        free=balanced_split(costs, p, num_chunks, megatron_flags=False))


def simulate_args(balance: StageBalance, num_microbatches: int, num_chunks: int = 1) -> list[str] | None:
    """``python -m trainer.schedule.simulate`` arguments that replay the fitted model (the run's split,
    embedding and head in layer units, a slower GPU as ``--straggler``) and simulate the re-split
    beside it: what the re-split buys a whole schedule, not only its slowest stage. None where the
    simulator cannot express the fit (it takes one straggler) within 2% of every measured stage."""
    costs = balance.costs
    layer = costs.layer
    straggler: list[str] = []
    speed: tuple[float, ...] = ()  # the slowest stage's speed only: all the simulator's --straggler says
    if costs.stage_speed:
        slow = max(range(len(costs.stage_speed)), key=lambda s: costs.stage_speed[s])
        factor = costs.stage_speed[slow]
        speed = tuple(factor if s == slow else 1.0 for s in range(len(costs.stage_speed)))
        if factor > 1.0 + 1e-6:
            straggler = ["--straggler", f"{slow}:{factor:.3g}"]
    expressible = LayerCosts(costs.num_layers, 1.0, costs.embedding / layer, costs.head / layer, speed,
                             costs.attention_share)
    replayed = [c * layer for c in expressible.stage_costs(balance.layers)]
    if any(abs(r / m - 1.0) > MIN_GAIN for r, m in zip(replayed, balance.stage_ms, strict=True)):
        return None
    schedules = "1f1b,zb-h1,dpp-zb" if num_chunks == 1 else "interleaved,dpp-zb"
    # The share the fit assumed, so the simulator's half layers (the run's, --resplit's) cost the same.
    share = ["--attention-share", f"{costs.attention_share:.3g}"] if costs.attention_share is not None else []
    return ["--pp", str(len(balance.layers)), "--vp", str(num_chunks), "--microbatches", str(num_microbatches),
            "--schedules", schedules, "--layers", str(costs.num_layers), "--split", describe_counts(balance.layers, ","),
            "--embedding-cost", f"{costs.embedding / layer:.3g}", "--head-cost", f"{costs.head / layer:.3g}",
            *straggler, *share, "--resplit"]


def describe(balance: StageBalance) -> str:
    """Two or three lines for a log or report."""
    b = balance
    where = (f"slowest in {round(b.slowest_share * b.iterations)} of {b.iterations} iterations"
             if b.slowest_share is not None else "slowest on average")
    times = "/".join(f"{ms:.1f}" for ms in b.stage_ms)
    head = (f"stage balance: stage {b.slowest} is {where}, {b.excess:+.0%} over the others' mean "
            f"(ms per iteration {times}; layers {describe_counts(b.layers)})")
    model = (f"  fitted: layer {b.costs.layer:.2f} ms, embedding {b.costs.embedding:.2f} ms, head "
             f"{b.costs.head:.2f} ms" + (f", stage speed {'/'.join(f'{x:.2f}' for x in b.costs.stage_speed)}"
                                         if b.costs.stage_speed else "") + f" ({b.fit})")
    if not b.persistent:
        verdict = (f"  balanced: no stage is persistently slowest by >= {MIN_EXCESS:.0%}"
                   + ("" if b.slowest_share is None else f" in >= {PERSISTENT_SHARE:.0%} of the iterations"))
    elif b.recommend:
        flags = " ".join(b.best.flags()) or "(the even split: drop both flags)"
        verdict = (f"  re-split {describe_counts(b.best.layers)}: {flags} -> slowest stage "
                   f"{b.best.bottleneck:.1f} ms predicted ({-b.gain:+.0%})")
    else:
        verdict = (f"  no Megatron split makes the slowest stage faster by >= {MIN_GAIN:.0%} "
                   f"(best {describe_counts(b.best.layers)}: {b.best.bottleneck:.1f} ms)")
    if b.persistent and b.free.bottleneck < b.best.bottleneck * (1 - MIN_GAIN):
        verdict += (f"; without Megatron's even middle stages ({' '.join(b.free.trainer_flags())}) "
                    f"{'/'.join(map(str, b.free.layers))} -> {b.free.bottleneck:.1f} ms")
    return "\n".join([head, model, verdict])
