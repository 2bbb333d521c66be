"""``python -m trainer.schedule.simulate``: compare pipeline schedules on a simulated step.

Example::

    python -m trainer.schedule.simulate --pp 4 --vp 2 --microbatches 32 --jitter 0.3 \\
        --schedules gpipe,1f1b,interleaved,zb-h1,dpp,dpp-zb --seeds 20 --trace out.json

prints one row per schedule: median step time, speedup vs 1F1B, step over the order-free bound of the
same costs (trainer/schedule/bound.py), bubble %, peak activations and the caps used.
``--cap-sweep 1,1.25,1.5,2`` prints throughput against the activation cap instead.
``--layers 16 --head-cost 2 --resplit`` derives the stage costs from a layer split and prints the
split that balances them (with Megatron-LM's flags for it), then the table for both splits.
``--layer-ops F:I:W --head-ops F:I:W --embedding-ops F:I:W`` give a layer's, the head's and the
embedding's measured op times instead (e.g. ms per microbatch), so a split replays a GPU's costs.
``--split 4.5/4/4/3.5`` places half layers (a stage boundary between a layer's attention and its MLP,
the trainer's ``--pipeline-stage-layers``); ``--attention-share`` says what the attention half costs,
and ``--resplit`` then also prints the balanced split in half layers (trainer/schedule/half_split.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

from trainer.cli import OneLineParser
from trainer.measure.flops import attention_share
from trainer.problems import problems_text
from trainer.schedule.backward_pool import MEASURED_COPY, PoolSpec
from trainer.schedule.compare import ScheduleSpec, Simulator, Summary, compare, run_once
from trainer.schedule.costs import CostModel
from trainer.schedule.dynamic import (
    CAP_BASES,
    CHUNK_CAPS,
    CHUNK_ORDERS,
    MICROBATCH_ORDERS,
    PRIORITIES,
    WEIGHT_ORDERS,
)
from trainer.schedule.half_split import (
    ChunkSplit,
    balanced_chunk_split,
    balanced_half_split,
    chunk_split_of,
    chunks_of_stages,
)
from trainer.schedule.host_ahead import simulate_host_ahead
from trainer.schedule.layers import LayerCosts, LayerOps, LayerSplit, balanced_split, split_of
from trainer.schedule.registry import DYNAMIC_SCHEDULES, POLICY_NAMES
from trainer.schedule.simulator import simulate
from trainer.schedule.stage_parts import parse_stage_layers
from trainer.schedule.trace import write_trace

ONE_CHUNK_SCHEDULES = ("gpipe", "1f1b", "zb-h1")
"""Run with one chunk per stage whatever --vp says (the classic forms being compared against)."""

DEFAULT_ATTENTION_SHARE = attention_share(hidden=2048, seq_length=1024, ffn_hidden=4 * 2048, heads=16)
"""The attention half's share of a layer's F, I, W by FLOPs for the benchmark model (GPT h2048, seq
1024, 16 heads, MLP 4h: 0.36, 0.385, 0.333): --attention-share's default."""


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m trainer.schedule.simulate",
        description=__doc__.split("\n\n")[0] + " Times are in cost units (1 unit = one forward "
        "of one microbatch through one whole stage, written as 1 ms in traces).",
    )
    add = parser.add_argument
    add("--pp", type=int, default=4, help="pipeline stages p (default 4)")
    add("--vp", type=int, default=2,
        help="model chunks per stage v for interleaved, dpp and dpp-zb (default 2); gpipe, 1f1b "
        "and zb-h1 always run with one chunk")
    add("--microbatches", type=int, default=32, help="microbatches per step M (default 32)")
    add("--schedules", default="gpipe,1f1b,interleaved,zb-h1,dpp,dpp-zb",
        help=f"comma-separated schedules from {', '.join(POLICY_NAMES)}")
    add("--jitter", type=float, default=0.0,
        help="per-op log-normal noise, as a coefficient of variation (0.3 = 30%%; default 0)")
    add("--seq-len-dist", default="none",
        help="per-microbatch sequence lengths: 'none' or 'lognormal:SIGMA' (length ratio with mean 1;"
        " op cost = (1-a)*r + a*r^2, a = --attention-fraction)")
    add("--attention-fraction", type=float, default=0.2,
        help="share of an op's cost quadratic in sequence length (default 0.2)")
    add("--straggler", default=None, help="'STAGE:FACTOR': that stage runs FACTOR times slower (e.g. 1:1.2)")
    add("--stalls", default=None,
        help="'PROB:DURATION[:STAGE[:OPS]]': each op of a whole stage is held up DURATION longer with chance"
        " PROB (transient stalls, e.g. 0.02:4); only STAGE's, and only its OPS (any of F, I, W; e.g."
        " 0.05:6:1:F, the benchmark's scenario c: rank 1's forwards)")
    add("--layers", type=int, default=None,
        help="transformer layers of the model: stage costs then come from a layer split (see"
        " --split, --layer-cost, --embedding-cost, --head-cost; --straggler is a slow GPU)")
    add("--layer-cost", type=float, default=1.0, help="with --layers: one layer's cost (default 1)")
    add("--embedding-cost", type=float, default=0.0,
        help="with --layers: extra cost of the first stage, in layer-cost units (default 0)")
    add("--head-cost", type=float, default=0.0,
        help="with --layers: extra cost of the last stage (output head + loss; default 0)")
    add("--layer-ops", default=None,
        help="with --layers: one layer's measured F:I:W per microbatch (e.g. 0.73:1.08:0.55; replaces"
        " --layer-cost, --forward, --input-grad, --weight-grad)")
    add("--embedding-ops", default=None, help="with --layer-ops: the first stage's extra F:I:W (default 0:0:0)")
    add("--head-ops", default=None,
        help="with --layer-ops: the last stage's extra F:I:W (output head and loss; default 0:0:0)")
    add("--split", default=None,
        help="with --layers: layers per stage, e.g. 5,4,4,3 (default even); x.5 = a stage boundary between a"
        " layer's attention and its MLP, e.g. 4.5/4/4/3.5 (the trainer's --pipeline-stage-layers); with --vp V"
        " and --layer-ops also one count per virtual stage, model order (chunk 0 of every stage first)")
    add("--attention-share", default=None,
        help="with --layers: the attention half's share of a layer (input norm, attention, residual add; the MLP"
        " half has the rest), one number or F:I:W per op; what half layers in --split and --resplit cost"
        " (default: by FLOPs of the benchmark model, GPT h2048 seq 1024, "
        + ":".join(f"{x:.3f}" for x in DEFAULT_ATTENTION_SHARE) + ")")
    add("--resplit", action="store_true",
        help="with --layers: print the balanced split (and Megatron-LM's flags for it) and simulate it too; also"
        " the balanced split in half layers (--pipeline-stage-layers) where its slowest stage is faster (with"
        " --vp V > 1 and --layer-ops: one count per virtual stage)")
    add("--forward", type=float, default=1.0, help="forward cost of one stage (default 1)")
    add("--input-grad", type=float, default=1.0, help="input-gradient (I) cost of one stage (default 1)")
    add("--weight-grad", type=float, default=1.0,
        help="weight-gradient (W) cost of one stage (default 1); B = I + W")
    add("--transfer", "--hop-latency", type=float, default=0.0,
        help="per-hop latency of every message (activation or gradient), for every schedule alike:"
        " sent at t, usable by the neighbour at t + this (copy + signal + launch; overlaps"
        " compute; in units of one stage's forward; default 0)")
    add("--edge-transfer", default=None,
        help="comma-separated time per edge s->s+1 (last = wrap-around p-1->0), overriding --transfer")
    add("--cap-factor", type=float, default=1.0,
        help="dpp/dpp-zb activation cap as a multiple of 1F1B's bound (default 1)")
    add("--cap-basis", choices=CAP_BASES, default=None,
        help="1F1B bound the cap multiplies: this stage's (p-s) or stage 0's (the per-GPU peak);"
        " default: stage for dpp, peak for dpp-zb")
    add("--chunk-caps", choices=CHUNK_CAPS, default="none",
        help="dpp/dpp-zb at --vp > 1: interleaved = each chunk holds at most what the interleaved order holds in"
        " it on the --cap-basis stage (the CUDA graph slots the interleaved order captures); none = only the"
        " stage's cap (default)")
    add("--held-caps", default=None, metavar="C0,C1,...",
        help="dpp/dpp-zb: each stage's held cap, set after the policy is built at --cap-basis's bounds (as the"
        " runtime sets a held cap fitted to memory, --dpp-held-cap fit; e.g. 4,3,3,2 with --cap-basis peak)")
    add("--priority", choices=PRIORITIES, default="forward",
        help="dpp/dpp-zb: what wins when a forward and a backward are both ready (default forward)")
    add("--chunk-order", choices=CHUNK_ORDERS, default="depth",
        help="dpp/dpp-zb: later chunks first (depth) or chunk 0 first (breadth) (default depth)")
    add("--backward-chunk-order", choices=CHUNK_ORDERS, default="breadth",
        help="dpp/dpp-zb backwards: earlier chunks first (depth) or later chunks first (breadth,"
        " default)")
    add("--reserve-owed", choices=("yes", "no"), default=None,
        help="dpp/dpp-zb: keep the cap's slots owed to started microbatches from new ones"
        " (default: yes for dpp, no for dpp-zb)")
    add("--microbatch-order", choices=MICROBATCH_ORDERS, default="cost",
        help="dpp/dpp-zb: order microbatches by their length-based cost estimates (cost, default)"
        " or by index")
    add("--static-microbatch-order", choices=MICROBATCH_ORDERS, default="index",
        help="static schedules: Megatron's index order (default) or the dynamic policies' cost"
        " order (as if the data loader sorted each step's microbatches)")
    add("--weight-order", choices=WEIGHT_ORDERS, default=None,
        help="dpp-zb: which deferred weight gradient fills idle time first (default youngest at"
        " v=1, oldest at v>1)")
    add("--drain-lag", choices=("yes", "no"), default=None,
        help="dpp-zb at v=1: once a stage's forwards are done, keep ZB-H1's lag of s deferred weight"
        " gradients until its last input gradient (yes, default) or fill idle time with all of them (no)")
    add("--land-forwards", choices=("yes", "no"), default=None,
        help="with --host-ahead --data-aware: run a landed op instead of a forward whose activation is"
        " still on the way (default yes for dpp-zb at v>1, no otherwise; DynamicOptions.land_forwards)")
    add("--host-ahead", action="store_true",
        help="decide at host time as the runtime does (trainer/schedule/host_ahead.py): an input is"
        " ready when its header arrives (posted when the producer is queued), each GPU runs its ops"
        " in decision order, waiting for input data; --hop-latency is then the data's delay")
    add("--launch-cost", type=float, default=0.02, help="with --host-ahead: host time to queue one op (default 0.02)")
    add("--header-latency", type=float, default=0.05,
        help="with --host-ahead: a header's host-to-host delay (default 0.05)")
    add("--max-queued-ops", type=int, default=0,
        help="with --host-ahead: decide only with at most this many queued ops unfinished on the GPU"
        " (the runtime's --dpp-max-queued-ops; default 0 = unbounded)")
    add("--data-aware", action="store_true",
        help="with --host-ahead: the host also knows which arrived inputs have landed on its GPU"
        " (the runtime does, for dpp-zb: StageLinks.landed)")
    add("--evacuation-sets", default=None,
        help="with --host-ahead: price a graphed split backward's backward pool (trainer/schedule/backward_pool.py):"
        " N buffer sets a stage's slots share for W's operands (the runtime's --dpp-graph-evacuation-sets; a slot"
        " finding none free runs its W at once), or 'slots' (a set per slot); default: the pool costs nothing")
    add("--evacuation-copy", type=float, default=MEASURED_COPY,
        help=f"with --evacuation-sets: an evacuation's GPU time as a share of the slot's W time (default {MEASURED_COPY},"
        " measured on 2xH200)")
    add("--seed", type=int, default=0, help="first random seed (default 0)")
    add("--seeds", type=int, default=1, help="number of seeds; figures are medians over them (default 1)")
    add("--cap-sweep", default=None,
        help="comma-separated cap factors (e.g. 1,1.25,1.5,2): print dpp/dpp-zb throughput vs cap instead")
    add("--sweep-vp", default="1,2", help="chunk counts for --cap-sweep (default 1,2)")
    add("--trace", default=None,
        help="write the first seed's Chrome trace here (one file per schedule: NAME.SCHEDULE.json"
        " when several schedules run)")
    return parser


def _parse_costs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> CostModel:
    seq_sigma = 0.0
    if args.seq_len_dist != "none":
        kind, _, value = args.seq_len_dist.partition(":")
        try:
            seq_sigma = float(value)
        except ValueError:
            seq_sigma = -1.0
        if kind != "lognormal" or seq_sigma < 0:
            parser.error(f"--seq-len-dist={args.seq_len_dist!r}: expected 'none' or 'lognormal:SIGMA'")
    straggler_stage, straggler_factor = None, 1.0
    if args.straggler:
        stage, _, factor = args.straggler.partition(":")
        try:
            straggler_stage, straggler_factor = int(stage), float(factor)
        except ValueError:
            parser.error(f"--straggler={args.straggler!r}: expected STAGE:FACTOR, e.g. 1:1.2")
        if not 0 <= straggler_stage < args.pp:
            parser.error(f"--straggler={args.straggler!r}: stage outside [0, --pp={args.pp})")
    edge_transfer: tuple[float, ...] = ()
    if args.edge_transfer:
        try:
            edge_transfer = tuple(float(t) for t in args.edge_transfer.split(","))
        except ValueError:
            parser.error(f"--edge-transfer={args.edge_transfer!r}: expected comma-separated numbers")
        if len(edge_transfer) != args.pp:
            parser.error(f"--edge-transfer has {len(edge_transfer)} values, need --pp={args.pp}")
    stall_probability, stall_duration, stall_stage, stall_ops = 0.0, 0.0, None, "FIW"
    if args.stalls:
        parts = args.stalls.split(":")
        try:
            stall_probability, stall_duration = float(parts[0]), float(parts[1])
            stall_stage = int(parts[2]) if len(parts) > 2 else None
            stall_ops = parts[3] if len(parts) > 3 else stall_ops
            if len(parts) > 4:
                raise ValueError
        except (ValueError, IndexError):
            parser.error(f"--stalls={args.stalls!r}: expected PROB:DURATION[:STAGE[:OPS]], e.g. 0.02:4 or 0.05:6:1:F")
    try:
        return CostModel(
            stall_probability=stall_probability, stall_duration=stall_duration, stall_stage=stall_stage,
            stall_ops=stall_ops,
            stage_scale=() if args.layer_ops else _stage_scale(args, parser, args.split_layers),
            stage_ops=_stage_ops(args, parser, args.split_layers),
            forward=args.forward, edge_transfer=edge_transfer, input_grad=args.input_grad, weight_grad=args.weight_grad,
            transfer=args.transfer, jitter=args.jitter, seq_len_sigma=seq_sigma,
            attention_fraction=args.attention_fraction, straggler_stage=straggler_stage,
            straggler_factor=straggler_factor,
        )
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


def _layer_ops(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LayerOps | None:
    """The parts' measured op times (--layer-ops and the others), or None without --layer-ops."""
    given = {"--layer-ops": args.layer_ops, "--embedding-ops": args.embedding_ops, "--head-ops": args.head_ops}
    if not args.layer_ops:
        if any(given.values()):
            parser.error("--embedding-ops / --head-ops need --layer-ops")
        return None
    if args.layers is None:
        parser.error("--layer-ops needs --layers")
    parts = []
    for flag, text in given.items():
        try:
            ops = tuple(float(x) for x in (text or "0:0:0").split(":"))
        except ValueError:
            ops = ()
        if len(ops) != 3:
            parser.error(f"{flag}={text!r}: expected F:I:W, three numbers, e.g. 0.73:1.08:0.55")
        parts.append(ops)
    try:
        return LayerOps(args.layers, *parts, attention_share=_attention_share(args, parser))
    except ValueError as error:
        parser.error(str(error))
        raise


def _attention_share(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[float, float, float]:
    """--attention-share as (F, I, W): one number for every op, or three."""
    if args.attention_share is None:
        return DEFAULT_ATTENTION_SHARE
    try:
        share = tuple(float(x) for x in args.attention_share.split(":"))
    except ValueError:
        share = ()
    if len(share) == 1:
        share *= 3
    if len(share) != 3 or not all(0 < x < 1 for x in share):
        parser.error(f"--attention-share={args.attention_share!r}: expected one number or F:I:W, each strictly"
                     " between 0 and 1 (e.g. 0.36 or 0.36:0.385:0.333)")
    return share


def _stage_ops(args: argparse.Namespace, parser: argparse.ArgumentParser,
               layers: tuple[float, ...] | None) -> tuple[tuple[float, float, float], ...]:
    """Measured op times of each stage, or with --vp V > 1 of each virtual stage (model order): the
    embedding in chunk 0 of stage 0, the head in the last chunk of the last stage."""
    ops = _layer_ops(args, parser)
    if ops is None or layers is None:
        return ()
    if args.vp > 1 and len(layers) == args.pp:  # a stage's chunks alike, as megatron-core lays out layers
        layers = chunks_of_stages(layers, args.vp)
    return ops.stage_ops(layers)


def _layer_costs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LayerCosts:
    speed = [1.0] * args.pp
    if args.straggler:  # a persistent slow GPU: the re-split should give it fewer layers
        stage, _, factor = args.straggler.partition(":")
        speed[int(stage)] = float(factor)
    ops = _layer_ops(args, parser)
    try:
        if ops is not None:
            return dataclasses.replace(ops.costs(), stage_speed=tuple(speed))
        # Without measured ops a stage costs --forward + --input-grad + --weight-grad per layer: the
        # attention half's share of that total weighs each op's share by those three.
        nominal = (args.forward, args.input_grad, args.weight_grad)
        share = sum(s * x for s, x in zip(_attention_share(args, parser), nominal, strict=True)) / sum(nominal)
        return LayerCosts(args.layers, args.layer_cost, args.embedding_cost, args.head_cost, tuple(speed), share)
    except ValueError as error:
        parser.error(str(error))
        raise


def _initial_split(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[float, ...] | None:
    if args.layers is None:
        if args.split or args.resplit or args.attention_share:
            parser.error("--split / --resplit / --attention-share need --layers")
        return None
    if args.split:
        try:
            layers = parse_stage_layers(args.split)
        except ValueError:
            parser.error(f"--split={args.split!r}: expected layer counts separated by ',' or '/'")
        virtual = args.vp > 1 and len(layers) == args.pp * args.vp
        if virtual and not args.layer_ops:
            parser.error(f"--split={args.split!r} has a count per virtual stage: chunk costs need --layer-ops")
        if ((len(layers) != args.pp and not virtual) or sum(layers) != args.layers
                or not all(n > 0 and float(2 * n).is_integer() for n in layers)):
            parser.error(f"--split={args.split!r}: need --pp={args.pp} counts > 0, in whole or half layers, summing"
                         f" to --layers={args.layers} (with --vp V > 1 also --pp x V, one per virtual stage)")
        return layers
    if args.layers % args.pp:
        parser.error(f"--layers={args.layers} is not divisible by --pp={args.pp}: give --split")
    return (args.layers // args.pp,) * args.pp


def _stage_scale(args: argparse.Namespace, parser: argparse.ArgumentParser,
                 layers: tuple[float, ...] | None) -> tuple[float, ...]:
    if layers is None:
        return ()
    # The straggler is applied by CostModel itself; the split's own costs exclude it here.
    return dataclasses.replace(_layer_costs(args, parser), stage_speed=()).stage_scale(layers)


def _dynamic_options(args: argparse.Namespace, cap_factor: float) -> dict:
    options = {"cap_factor": cap_factor, "priority": args.priority, "chunk_order": args.chunk_order,
               "backward_chunk_order": args.backward_chunk_order,
               "microbatch_order": args.microbatch_order}
    if args.weight_order is not None:
        options["weight_order"] = args.weight_order
    if args.cap_basis is not None:
        options["cap_basis"] = args.cap_basis
    if args.reserve_owed is not None:
        options["reserve_owed"] = args.reserve_owed == "yes"
    if args.drain_lag is not None:
        options["drain_lag"] = args.drain_lag == "yes"
    if args.land_forwards is not None:
        options["land_forwards"] = args.land_forwards == "yes"
    if args.chunk_caps != "none":
        options["chunk_caps"] = args.chunk_caps
    return options


def _held_caps(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, ...]:
    if args.held_caps is None:
        return ()
    try:
        caps = tuple(int(c) for c in args.held_caps.split(","))
    except ValueError:
        parser.error(f"--held-caps={args.held_caps!r}: expected comma-separated whole numbers, one per stage")
    if len(caps) != args.pp or min(caps) < 1:
        parser.error(f"--held-caps={args.held_caps!r}: one cap >= 1 per stage (--pp {args.pp})")
    return caps


def _specs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[ScheduleSpec]:
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        parser.error(f"--schedules: unknown {unknown or 'empty list'}; choose from {', '.join(POLICY_NAMES)}")
    if "interleaved" in names and args.vp < 2:
        parser.error(f"--schedules includes interleaved, which needs --vp >= 2 (got --vp {args.vp})")
    specs = []
    for name in names:
        chunks = 1 if name in ONE_CHUNK_SCHEDULES else args.vp
        options = _dynamic_options(args, args.cap_factor) if name in DYNAMIC_SCHEDULES else {}
        if name not in DYNAMIC_SCHEDULES and args.static_microbatch_order != "index":
            options = {"microbatch_order": args.static_microbatch_order}
        held = _held_caps(args, parser) if name in DYNAMIC_SCHEDULES else ()
        specs.append(ScheduleSpec(name, chunks, options, held))
    return specs


def _format_table(baseline: Summary, rows: list[Summary]) -> str:
    header = (f"{'schedule':<12} {'v':>2} {'step':>9} {'vs 1F1B':>8} {'vs bound':>8} {'bubble':>7} {'peak act':>8}  "
              "caps (held[/live] per stage)")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.spec.name:<12} {row.spec.num_chunks:>2} {row.step_time:>9.2f} "
            f"{row.speedup - 1:>+7.1%} {row.vs_bound:>7.3f}x {row.bubble:>7.1%} {row.peak_activations:>8.2f}  {row.caps}"
        )
    lines.append(f"(1F1B baseline: median step {baseline.step_time:.2f}; 'vs 1F1B' = median over seeds of"
                 " 1F1B step / schedule step - 1; 'vs bound' = median over seeds of the step / the order-free bound"
                 " of the same costs; peak act in whole-stage microbatch activations)")
    bounds = {row.spec.num_chunks: row.bound for row in [baseline, *rows] if row.bound is not None}
    for chunks, bound in sorted(bounds.items()):
        lines.append(f"order-free bound, v={chunks} (no order runs these costs faster; first seed): {bound.describe()}")
    for row in (row for row in rows if row.pool):
        lines.append(f"backward pool, {row.spec.name} v={row.spec.num_chunks}: per stage W's read in place / "
                     f"evacuations / W's run early (medians over seeds): {row.pool}")
    return "\n".join(lines)


def _cap_sweep(args, parser, costs: CostModel, seeds: list[int], simulator: Simulator = simulate) -> str:
    try:
        factors = [float(f) for f in args.cap_sweep.split(",")]
        chunk_counts = [int(v) for v in args.sweep_vp.split(",")]
    except ValueError:
        parser.error(f"--cap-sweep={args.cap_sweep!r} / --sweep-vp={args.sweep_vp!r}: expected comma-separated numbers")
    names = [n for n in args.schedules.split(",") if n in DYNAMIC_SCHEDULES] or list(DYNAMIC_SCHEDULES)
    lines = [f"{'schedule':<8} {'v':>2} " + " ".join(f"{f'{f:g}x cap':>15}" for f in factors)]
    for name in names:
        for v in chunk_counts:
            specs = [ScheduleSpec(name, v, _dynamic_options(args, f)) for f in factors]
            _, rows = compare(specs, args.pp, args.microbatches, costs, seeds, simulator)
            cells = [f"{r.speedup - 1:+.1%} @{r.peak_activations:.2f}" for r in rows]
            lines.append(f"{name:<8} {v:>2} " + " ".join(f"{c:>15}" for c in cells))
    lines.append("(speedup = median over seeds of 1F1B step / schedule step - 1; @ = peak activations"
                 " held by any stage, in whole-stage microbatch units: 1F1B holds p;"
                 " cap = factor x 1F1B's bound, see --cap-basis)")
    return "\n".join(lines)


def _write_traces(args, specs: list[ScheduleSpec], costs: CostModel, simulator: Simulator = simulate) -> list[Path]:
    target = Path(args.trace)
    written = []
    for spec in specs:
        path = target if len(specs) == 1 else target.with_name(f"{target.stem}.{spec.name}{target.suffix}")
        result = run_once(spec, args.pp, args.microbatches, costs, args.seed, record=True, simulator=simulator)
        written.append(write_trace(path, result))
    return written


def _resplits(costs: LayerCosts, args: argparse.Namespace) -> list[LayerSplit | ChunkSplit]:
    """The balanced split Megatron's flags express, the free one in whole layers and the one in half
    layers, each where its slowest stage is faster than the ones before; with --vp V > 1 and measured op
    times, Megatron's and the one in half layers per virtual stage (its chunks apart)."""
    splits: list[LayerSplit | ChunkSplit] = [balanced_split(costs, args.pp, args.vp if args.layers % args.vp == 0 else 1)]
    if args.vp > 1:
        candidates = [balanced_chunk_split(costs, args.pp, args.vp)] if args.layer_ops else []
    else:
        candidates = [balanced_split(costs, args.pp, 1, megatron_flags=False), balanced_half_split(costs, args.pp)]
    for split in candidates:
        if split.bottleneck < min(s.bottleneck for s in splits) - 1e-9:
            splits.append(split)
    return splits


def _split_of(costs: LayerCosts, args: argparse.Namespace) -> LayerSplit | ChunkSplit:
    layers = args.split_layers
    return chunk_split_of(costs, layers, args.pp) if len(layers) > args.pp else split_of(costs, layers)


def _simulator(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Simulator:
    """GPU-time decisions (the default) or, with --host-ahead, the runtime's host-time decisions."""
    if not args.host_ahead:
        if args.data_aware:
            parser.error("--data-aware applies to --host-ahead (at GPU time every arrived input has landed)")
        if args.evacuation_sets is not None:
            parser.error("--evacuation-sets applies to --host-ahead (the backward pool is the graphed runtime's)")
        return simulate
    bad = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in ("launch_cost", "header_latency", "max_queued_ops")
           if getattr(args, n) < 0]
    if bad:
        parser.error(problems_text(bad, "must be >= 0"))
    return functools.partial(simulate_host_ahead, launch=args.launch_cost, header_latency=args.header_latency,
                             max_queued_ops=args.max_queued_ops or None, data_aware=args.data_aware,
                             pool=_pool_spec(args, parser))


def _pool_spec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> PoolSpec | None:
    """--evacuation-sets / --evacuation-copy (host-time model only)."""
    sets = args.evacuation_sets
    if sets is None:
        return None
    if sets != "slots" and not (sets.isdigit() and int(sets) >= 1):
        parser.error(f"--evacuation-sets={sets!r} must be 'slots' or a number >= 1")
    if args.evacuation_copy < 0:
        parser.error(f"--evacuation-copy={args.evacuation_copy} must be >= 0")
    return PoolSpec(None if sets == "slots" else int(sets), args.evacuation_copy)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    bad = [f"--{n}={getattr(args, n)}" for n in ("pp", "vp", "microbatches", "seeds") if getattr(args, n) < 1]
    if bad:
        parser.error(problems_text(bad, "must be >= 1"))
    args.split_layers = _initial_split(args, parser)
    costs = _parse_costs(args, parser)
    simulator = _simulator(args, parser)
    seeds = list(range(args.seed, args.seed + args.seeds))
    try:
        if args.cap_sweep:
            print(_cap_sweep(args, parser, costs, seeds, simulator))
            return 0
        specs = _specs(args, parser)
        if args.split_layers is not None:
            layer_costs = _layer_costs(args, parser)
            print(f"layer split: {_split_of(layer_costs, args).describe()}")
        baseline, rows = compare(specs, args.pp, args.microbatches, costs, seeds, simulator)
        print(_format_table(baseline, rows))
        if args.resplit:
            for split in _resplits(layer_costs, args):
                print(f"\nre-split: {split.describe()}")
                resplit_costs = dataclasses.replace(
                    costs, stage_ops=_stage_ops(args, parser, split.layers),
                    stage_scale=() if args.layer_ops else _stage_scale(args, parser, split.layers))
                baseline, rows = compare(specs, args.pp, args.microbatches, resplit_costs, seeds, simulator)
                print(_format_table(baseline, rows))
        if args.trace:
            for path in _write_traces(args, specs, costs, simulator):
                print(f"trace written: {path}")
    except ValueError as error:  # e.g. interleaved with M not a multiple of p
        return parser.report(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
