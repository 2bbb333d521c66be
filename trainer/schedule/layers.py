"""Which transformer layers each pipeline stage and model chunk holds (pure, no torch).

Megatron-LM's uneven split: ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``
(megatron-core ``TransformerConfig.num_layers_in_first_pipeline_stage`` / ``..._last_...``, present in
0.16 and 0.19) give the first / last stage F / L layers and spread the rest evenly over the middle
stages. A stage carrying the embedding or the output head over a 50k vocabulary does more work than
its layers say (the head weighs about two layers at hidden 2048), so e.g. 16 layers on 4 stages run
faster as 5/4/4/3 than 4/4/4/4 (docs/benchmarks.md#reference-megatron-core-alone-on-4-h200s).

:func:`split_problems` states megatron-core's rules (``TransformerConfig.__post_init__`` and
``get_num_layers_to_build``) as messages naming the flags; :func:`stage_layers` reproduces
``get_transformer_layer_offset`` so a rank, a test or a log line knows the global layer indices of
every chunk without building a model. With VP, chunk ``c`` of stage ``s`` holds layers
``[c*T + offset(s), ...)`` where ``T`` is the layers per "virtual round" -- megatron-core's own
interleaved order, which tests/unit/test_layer_split.py checks against the installed package.

:func:`balanced_split` is the one answer to "which split should this model have": the split whose
slowest stage is fastest under a :class:`LayerCosts` model (the benchmark's default split, the
simulator's ``--resplit`` and the stage-balance advice all ask it), found among the splits
:func:`split_problems` accepts, so it never recommends a split the trainer refuses.

Counts may be half layers (``--pipeline-stage-layers 4.5,4,4,3.5``, trainer/schedule/stage_parts.py):
:class:`LayerCosts` and :class:`LayerOps` then need the attention half's share of a layer
(``attention_share``), and trainer/schedule/half_split.py finds the balanced split over half units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.problems import raise_if_any
from trainer.schedule.stage_parts import STAGE_LAYERS_FLAG, half_bounds, layer_count
from trainer.schedule.stage_parts import describe as describe_counts

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"


def split_problems(num_layers: int, pp: int, vp: int, first: int | None, last: int | None) -> list[str]:
    """Every way ``num_layers`` cannot be laid out on ``pp`` stages of ``vp`` chunks, evenly (no
    first/last) or unevenly (empty list: it can). The one statement of the rules: the trainer's
    configuration checks (:func:`stage_split_problems`) and :func:`balanced_split` both ask it."""
    if first is None and last is None:
        return _even_split_problems(num_layers, pp, vp)
    p: list[str] = []
    given = {FIRST_FLAG: first, LAST_FLAG: last}
    for flag, value in given.items():
        if value is not None and value < 1:
            p.append(f"{flag}={value} must be >= 1")
    if pp < 2:
        p.append(f"{FIRST_FLAG} / {LAST_FLAG} need --pipeline-model-parallel-size > 1 (got {pp})")
    if p:
        return p
    for flag, value in given.items():
        if value is not None and vp > 1 and value % vp:
            p.append(f"{flag}={value} is not divisible by the {vp} virtual stages per pipeline rank")
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    named = " + ".join(f"{flag}={value}" for flag, value in given.items() if value is not None)
    if middle_layers < 0:
        p.append(f"{named} is more than --num-layers={num_layers}")
    elif bool(middle_layers) != bool(middle_stages):
        p.append(f"--num-layers={num_layers} minus {named} leaves {middle_layers} layers for "
                 f"{middle_stages} middle stages of --pipeline-model-parallel-size={pp}")
    elif middle_stages and middle_layers % middle_stages:
        p.append(f"the {middle_layers} layers left after {named} are not divisible by the "
                 f"{middle_stages} middle stages of --pipeline-model-parallel-size={pp}")
    elif middle_stages and vp > 1 and (middle_layers // middle_stages) % vp:
        p.append(f"{middle_layers // middle_stages} layers per middle stage (after {named}) are not "
                 f"divisible by the {vp} virtual stages per pipeline rank")
    return p


def _even_split_problems(num_layers: int, pp: int, vp: int) -> list[str]:
    """megatron-core's even split: every stage the same count, every chunk of a stage the same count."""
    if pp >= 1 and num_layers % pp:
        return [f"--num-layers={num_layers} is not divisible by --pipeline-model-parallel-size={pp}"]
    if vp > 1 and (pp == 1 or (num_layers // pp) % vp):
        return [f"--num-virtual-stages-per-pipeline-rank={vp} needs --pipeline-model-parallel-size > 1 "
                f"and divides the {num_layers // max(pp, 1)} layers per stage"]
    return []


def stage_split_problems(num_layers: int, pp: int, first: int | None = None, last: int | None = None,
                         virtual_stages: int | None = None, layers_per_virtual_stage: int | None = None) -> list[str]:
    """How the layers cannot be placed on the stages and chunks the flags ask for, named by those flags:
    ``virtual_stages`` is ``--num-virtual-stages-per-pipeline-rank``, ``layers_per_virtual_stage``
    ``--num-layers-per-virtual-pipeline-stage`` (their exclusion is the parallel section's check)."""
    if first is not None or last is not None:
        return split_problems(num_layers, pp, virtual_stages or 1, first, last)
    if layers_per_virtual_stage is None:
        return split_problems(num_layers, pp, virtual_stages or 1, None, None)
    if num_layers % pp:
        return split_problems(num_layers, pp, 1, None, None)
    if pp == 1:
        return [f"--num-layers-per-virtual-pipeline-stage={layers_per_virtual_stage} needs "
                "--pipeline-model-parallel-size > 1"]
    if (num_layers // pp) % layers_per_virtual_stage:
        return [f"--num-layers={num_layers} / --pipeline-model-parallel-size={pp} = "
                f"{num_layers // pp} layers per stage is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage={layers_per_virtual_stage}"]
    return []


def layers_per_stage(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Transformer layers on each pipeline stage (all chunks together). Raises ValueError naming the
    rule for a split :func:`split_problems` refuses (12 layers on 8 stages has no even split)."""
    raise_if_any(split_problems(num_layers, pp, 1, first, last), f"no layer split of {num_layers} layers on {pp} stages")
    middle_stages = pp - (first is not None) - (last is not None)
    middle = (num_layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layers(num_layers: int, pp: int, vp: int = 1, first: int | None = None,
                 last: int | None = None) -> list[list[list[int]]]:
    """``[stage][chunk] -> global 0-based layer indices``, megatron-core's placement."""
    counts = layers_per_stage(num_layers, pp, first, last)
    per_chunk = [n // vp for n in counts]
    round_size = sum(per_chunk)  # layers in one virtual round (chunk c of every stage)
    out = []
    for s in range(pp):
        offset = sum(per_chunk[:s])
        out.append([list(range(c * round_size + offset, c * round_size + offset + per_chunk[s]))
                    for c in range(vp)])
    return out


def describe_split(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> str:
    """``"5/4/4/3"``: layers per stage, for logs and reports."""
    return "/".join(map(str, layers_per_stage(num_layers, pp, first, last)))


@dataclass(frozen=True)
class LayerCosts:
    """Measured (or estimated) compute of the parts of a model, in any one unit."""

    num_layers: int
    """Transformer layers of the whole model."""
    layer: float = 1.0
    """One layer's forward + backward time."""
    embedding: float = 0.0
    """Extra time of the first stage: the embedding (and its gradient)."""
    head: float = 0.0
    """Extra time of the last stage: output head and loss (about two layers at hidden 2048 and a
    50k vocabulary, docs/benchmarks.md#reference-megatron-core-alone-on-4-h200s)."""
    stage_speed: tuple[float, ...] = ()
    """Slowdown of each stage (1.2 = that GPU runs 20% slower); empty: all 1."""
    attention_share: float | None = None
    """Share of ``layer`` in its attention half (input norm, attention, its residual add); the MLP
    half (pre-MLP norm, MLP) takes the rest. What a stage boundary inside a layer moves; None: counts
    in half layers cannot be costed (trainer.measure.flops.attention_share estimates it from FLOPs)."""

    def __post_init__(self) -> None:
        problems = []
        if self.attention_share is not None and not 0 < self.attention_share < 1:
            problems.append(f"attention_share={self.attention_share} must lie strictly between 0 and 1")
        if self.num_layers < 1:
            problems.append(f"num_layers={self.num_layers} must be >= 1")
        if not (math.isfinite(self.layer) and self.layer > 0):
            problems.append(f"layer={self.layer} must be a finite number > 0")
        for name in ("embedding", "head"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name}={value} must be a finite number >= 0")
        bad = [x for x in self.stage_speed if not (math.isfinite(x) and x > 0)]
        if bad:
            problems.append(f"stage_speed={self.stage_speed} has values that are not finite numbers > 0: {bad}")
        raise_if_any(problems, "invalid layer costs")

    def stage_cost(self, stage: int, num_stages: int, layers: float) -> float:
        extra = (self.embedding if stage == 0 else 0.0) + (self.head if stage == num_stages - 1 else 0.0)
        speed = self.stage_speed[stage] if self.stage_speed else 1.0
        return speed * (layers * self.layer + extra)

    def parts_cost(self, stage: int, num_stages: int, attention: int, mlp: int) -> float:
        """A stage's time holding ``attention`` attention halves and ``mlp`` MLP halves (a whole
        layer is one of each)."""
        if attention == mlp:
            return self.stage_cost(stage, num_stages, attention)
        share = _needs_share(self.attention_share)
        return self.stage_cost(stage, num_stages, attention * share + mlp * (1.0 - share))

    def stage_costs(self, layers: Sequence[float]) -> list[float]:
        """Each stage's time for ``layers[s]`` layers on stage ``s`` (x.5: a boundary inside a layer)."""
        if self.stage_speed and len(self.stage_speed) != len(layers):
            raise ValueError(f"stage_speed has {len(self.stage_speed)} entries for {len(layers)} stages")
        return [self.parts_cost(s, len(layers), a, m) for s, (a, m) in enumerate(half_counts(layers))]

    def stage_scale(self, layers: Sequence[float]) -> tuple[float, ...]:
        """Stage costs relative to an even split without embedding or head (the simulator's
        unit: ``CostModel.stage_scale``)."""
        even = self.num_layers * self.layer / len(layers)
        return tuple(c / even for c in self.stage_costs(layers))


def half_counts(layers: Sequence[float]) -> list[tuple[int, int]]:
    """(attention halves, MLP halves) of each stage: ``[(5, 4), (4, 4), (4, 4), (3, 4)]`` for 4.5/4/4/3.5
    (the stage after a split layer starts with its MLP). ValueError for a count not in half layers."""
    bad = [n for n in layers if not (math.isfinite(n) and n >= 0 and float(2 * n).is_integer())]
    raise_if_any([f"layers per stage {describe_counts(layers)}: {', '.join(map(str, bad))} not whole or half "
                  "numbers >= 0"] if bad else [])
    bounds = half_bounds(layers)
    # Unit 2k is layer k's attention, 2k + 1 its MLP: count the even units of [start, end).
    return [((end + 1) // 2 - (start + 1) // 2, (end - start) - ((end + 1) // 2 - (start + 1) // 2))
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def _needs_share(share):
    """``share``, or ValueError naming it: a stage holding half a layer has no cost without it."""
    if share is None:
        raise ValueError("half layers per stage need the attention half's share of a layer (attention_share)")
    return share


Ops = tuple[float, float, float]
"""(F, I, W): forward, input-gradient and weight-gradient time of one microbatch."""


@dataclass(frozen=True)
class LayerOps:
    """Measured per-op times of the parts of a model: what the simulator needs to replay a split
    (``CostModel.stage_ops``) where :class:`LayerCosts` gives only each stage's total."""

    num_layers: int
    layer: Ops
    embedding: Ops = (0.0, 0.0, 0.0)
    """The first stage's extra ops."""
    head: Ops = (0.0, 0.0, 0.0)
    """The last stage's extra ops (output head and loss)."""
    attention_share: Ops | None = None
    """The attention half's share of each op (F, I, W) of a layer (measured, or from FLOPs:
    trainer.measure.flops.attention_share); None: counts in half layers cannot be replayed."""

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)} must be three finite numbers >= 0 (F, I, W)"
                    for name in ("layer", "embedding", "head")
                    if len(getattr(self, name)) != 3
                    or not all(math.isfinite(x) and x >= 0 for x in getattr(self, name))]
        if not problems and min(self.layer) <= 0:
            problems.append(f"layer={self.layer}: each op of a layer must take time > 0")
        share = self.attention_share
        if share is not None and (len(share) != 3 or not all(0 < x < 1 for x in share)):
            problems.append(f"attention_share={share} must be three numbers strictly between 0 and 1 (F, I, W)")
        raise_if_any(problems, "invalid layer op times")

    def costs(self) -> LayerCosts:
        """The same model as stage totals (what :func:`balanced_split` balances); the attention
        half's share of the total weighs each op's share by the op's time."""
        share = self.attention_share
        total_share = (None if share is None
                       else sum(s * x for s, x in zip(share, self.layer, strict=True)) / sum(self.layer))
        return LayerCosts(self.num_layers, sum(self.layer), sum(self.embedding), sum(self.head),
                          attention_share=total_share)

    def stage_ops(self, layers: Sequence[float]) -> tuple[Ops, ...]:
        """(F, I, W) of one microbatch on each stage holding ``layers[s]`` layers (x.5: half layers)."""
        last = len(layers) - 1
        out = []
        for s, (attention, mlp) in enumerate(half_counts(layers)):
            if attention == mlp:  # whole layers: the share is not needed
                parts = tuple(attention * x for x in self.layer)
            else:
                share = _needs_share(self.attention_share)
                parts = tuple((attention * a + mlp * (1.0 - a)) * x for a, x in zip(share, self.layer, strict=True))
            out.append(tuple(n + (e if s == 0 else 0.0) + (h if s == last else 0.0)
                             for n, e, h in zip(parts, self.embedding, self.head, strict=True)))
        return tuple(out)


@dataclass(frozen=True)
class LayerSplit:
    """A layer count per stage, with its stage costs and, when Megatron can lay it out, its flags."""

    layers: tuple[float, ...]
    """Layers per stage; x.5 (a boundary inside a layer) only in a split of half units."""
    stage_costs: tuple[float, ...]
    first: int | None = None
    """``--decoder-first-pipeline-num-layers``, or None (not needed or not expressible)."""
    last: int | None = None
    """``--decoder-last-pipeline-num-layers``, or None."""
    megatron: bool = True
    """Whether Megatron-LM's two flags express ``layers`` (else the trainer's --pipeline-stage-layers does)."""

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs)

    def flags(self) -> list[str]:
        """Megatron-LM's command-line flags for this split ([] for the even split)."""
        if not self.megatron:
            raise ValueError(f"layers {list(self.layers)} cannot be expressed with {FIRST_FLAG} / {LAST_FLAG}")
        out = []
        if self.first is not None:
            out += [FIRST_FLAG, str(self.first)]
        if self.last is not None:
            out += [LAST_FLAG, str(self.last)]
        return out

    def trainer_flags(self) -> list[str]:
        """The trainer's flags for this split: Megatron-LM's two where they express it (users know
        them), else ``--pipeline-stage-layers`` with every stage's count."""
        if self.megatron:
            return self.flags()
        return [STAGE_LAYERS_FLAG, describe_counts(self.layers, ",")]

    def describe(self) -> str:
        layout = describe_counts(self.layers)
        costs = ", ".join(f"{c:.2f}" for c in self.stage_costs)
        flags = " ".join(self.trainer_flags()) or "(even: no flags)"
        if not self.megatron and all(float(n).is_integer() for n in self.layers):
            flags += " (not expressible by Megatron's flags)"
        return f"{layout} layers, stage costs {costs} (slowest {self.bottleneck:.2f}); {flags}"


def split_of(costs: LayerCosts, layers: Sequence[float], num_chunks: int = 1) -> LayerSplit:
    """``layers`` as a :class:`LayerSplit` (its stage costs, and Megatron's flags if any)."""
    layers = tuple(map(layer_count, layers))
    flags = _as_megatron(layers, costs.num_layers, len(layers), num_chunks)
    first, last = flags if flags else (None, None)
    return LayerSplit(layers, tuple(costs.stage_costs(layers)), first, last, megatron=flags is not None)


def cost_key(split_costs: list[float]) -> tuple[float, ...]:
    """How splits compare first, smaller is better: the stage costs slowest first (the bottleneck, then
    the next slowest...), so among equal bottlenecks the flatter split wins; rounded, so sums of the same
    costs in another order tie."""
    return tuple(round(c, 9) for c in sorted(split_costs, reverse=True))


def _split_order(stage_costs: list[float], layers: Sequence[int], first: int | None, last: int | None,
                 num_layers: int) -> tuple:
    """How :func:`balanced_split` ranks Megatron layouts, best first: (1) the sorted stage costs,
    slowest first (the bottleneck, then the next slowest...); on a tie (2) the split closest to even
    (least sum of squared differences from the even count: several small moves before one large);
    (3) fewer flags; (4) the larger first stage. With the
    head weighing two layers and no embedding cost, 16 layers on 4 stages tie at 5/4/4/3 and
    4/5/5/2; (2) picks 5/4/4/3, the split measured best on 4 GPUs (docs/benchmarks.md)."""
    even = num_layers / len(layers)
    moved = round(sum((n - even) ** 2 for n in layers), 9)
    return cost_key(stage_costs), moved, (first is not None) + (last is not None), -layers[0]


def balanced_split(costs: LayerCosts, num_stages: int, num_chunks: int = 1,
                   megatron_flags: bool = True) -> LayerSplit:
    """The layer split whose slowest stage is fastest (ties: :func:`_split_order`).

    ``megatron_flags``: only splits that Megatron-LM's first/last-stage flags express (middle
    stages even, every count divisible by ``num_chunks``); else any count per stage (a multiple
    of ``num_chunks``, at least one layer per chunk), found by trying every bottleneck value.
    """
    p, v, n = num_stages, num_chunks, costs.num_layers
    if p < 1 or v < 1:
        raise ValueError(f"num_stages={p} and num_chunks={v} must be >= 1")
    if costs.stage_speed and len(costs.stage_speed) != p:
        raise ValueError(f"stage_speed has {len(costs.stage_speed)} entries, need num_stages={p}")
    if n < p * v:
        raise ValueError(f"num_layers={n} < num_stages * num_chunks = {p * v}: a chunk needs a layer")
    if megatron_flags:
        return _best_megatron_split(costs, p, v)
    return _best_free_split(costs, p, v)


def _best_megatron_split(costs: LayerCosts, p: int, v: int) -> LayerSplit:
    options: list[tuple[int | None, int | None]] = [(None, None)]
    if p > 1:
        counts = [None, *range(v, costs.num_layers + 1, v)]
        options = [(first, last) for first in counts for last in counts]
    best = None
    for first, last in options:
        if split_problems(costs.num_layers, p, v, first, last):
            continue
        layers = layers_per_stage(costs.num_layers, p, first, last)
        if min(layers) < v:
            continue
        stage_costs = costs.stage_costs(layers)
        key = _split_order(stage_costs, layers, first, last, costs.num_layers)
        if best is None or key < best[0]:
            best = (key, LayerSplit(tuple(layers), tuple(stage_costs), first, last))
    if best is None:
        raise ValueError(f"no Megatron layout of {costs.num_layers} layers on {p} stages x {v} chunks")
    return best[1]


def _best_free_split(costs: LayerCosts, p: int, v: int) -> LayerSplit:
    n = costs.num_layers
    if n % v:
        raise ValueError(f"num_layers={n} is not divisible by num_chunks={v}")
    units = n // v  # layers move between stages v at a time (one per chunk)
    candidates = sorted({costs.stage_cost(s, p, k * v) for s in range(p) for k in range(1, units + 1)})
    for bound in candidates:  # the smallest bottleneck for which every layer finds a stage
        room = [max((k for k in range(1, units + 1) if costs.stage_cost(s, p, k * v) <= bound + 1e-12),
                    default=0) for s in range(p)]
        if min(room) >= 1 and sum(room) >= units:
            break
    else:  # pragma: no cover - the largest candidate always fits
        raise AssertionError("no bound fits")
    counts = list(room)
    while sum(counts) > units:  # give back surplus from the stages that would run slowest
        s = max((s for s in range(p) if counts[s] > 1),
                key=lambda s: (costs.stage_cost(s, p, counts[s] * v), s))
        counts[s] -= 1
    counts = _flatten(costs, counts, p, v)
    return split_of(costs, [k * v for k in counts], v)


def _flatten(costs: LayerCosts, counts: list[int], p: int, v: int) -> list[int]:
    """Move one chunk's layers at a time while that makes the sorted stage costs smaller: among
    splits with the same slowest stage, the one whose next slowest is fastest (and so on)."""
    def key(c: list[int]) -> tuple[float, ...]:
        return cost_key([costs.stage_cost(s, p, k * v) for s, k in enumerate(c)])

    best = key(counts)
    while True:
        moves = [(key(c), c) for s in range(p) for t in range(p) if s != t and counts[s] > 1
                 for c in [[k - (i == s) + (i == t) for i, k in enumerate(counts)]]]
        new_key, new_counts = min(moves, default=(best, counts))
        if new_key >= best:
            return counts
        best, counts = new_key, new_counts


def _as_megatron(layers: tuple[float, ...], n: int, p: int, v: int) -> tuple[int | None, int | None] | None:
    """(first, last) flags that lay ``layers`` out in Megatron-LM, or None if none do (half layers never)."""
    if not all(float(k).is_integer() for k in layers):
        return None
    for first in (None, layers[0]):
        for last in (None, layers[-1]):
            if p > 1 and sum(layers) == n and not split_problems(n, p, v, first, last) \
                    and tuple(layers_per_stage(n, p, first, last)) == layers:
                return first, last
    return (None, None) if p == 1 else None
