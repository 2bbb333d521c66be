"""The run plan: which schedule runs, why, its options, the layer split and the link options, decided once.

:func:`resolve_plan` turns a checked :class:`TrainConfig` and the world size into a frozen
:class:`RunPlan`; the training session, the pipeline runtime, the first log line, the metrics and
the benchmark read it, and nothing downstream decides again from the flags (tests/unit/test_plan.py
holds every module to that). The schedule's refusals live here too (:func:`schedule_problems`,
run by the layout checks), next to the choice they guard.

Where a change goes (docs/house.md):
- a new runtime policy: its builder in trainer/schedule/registry.py, then the branch that chooses it
  in :func:`_choose_schedule` (with its reason) and, if a flag names it, DPP_POLICIES in
  trainer/config/sections.py;
- a new refusal of a schedule choice: a line in :func:`schedule_problems` (or the ``why`` table of the
  check it belongs to), naming the flags and the way out;
- a new schedule option: a field of :class:`SchedulePlan` (or :class:`PolicyOptions`), set here, read
  where it acts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.config.optim import resolve_torch_optimizer_impl
from trainer.config.sections import STATIC_DPP_POLICIES
from trainer.config.training import TrainConfig
from trainer.config.transformer_engine import (
    TE_ATTENTION_BACKENDS,
    installed,
    te_rng_tracker,
    uses_transformer_engine_spec,
)
from trainer.schedule.core import PipelineShape
from trainer.schedule.dynamic import scaled_cap
from trainer.schedule.layers import describe_split, layers_per_stage, stage_layers
from trainer.schedule.registry import SPLIT_BACKWARD
from trainer.schedule.stage_parts import describe as describe_stage_layers
from trainer.schedule.stage_parts import layer_count, splits_inside_layers, whole_layers

Engine = Literal["megatron-core", "runtime"]
MEGATRON: Engine = "megatron-core"
"""megatron-core's ``get_forward_backward_func()`` (1F1B, interleaved 1F1B) runs the pipeline."""
RUNTIME: Engine = "runtime"
"""This project's pipeline runtime (trainer/pipeline/) runs it, driven by a policy of trainer/schedule/."""

DEFAULT_LINK_CREDITS = 4
"""Receive slots per channel when no policy needs more (trainer.transport.factory.LinkOptions' default)."""


@dataclass(frozen=True)
class PolicyOptions:
    """Options of the runtime's dynamic policies (``make_policy(name, ..., **as_kwargs())``)."""

    max_inflight: int | None = None
    """--dpp-max-inflight: a fixed cap on held activations; None: cap_factor x 1F1B's cap."""
    cap_factor: float = 1.0
    """--dpp-cap-factor."""
    fill_transit: bool | None = None
    """dpp-zb only (--no-dpp-fill-transit); None for the other policies."""
    cap_basis: str | None = None
    """--dpp-held-cap stage/peak; None for auto (the policy's own default)."""
    chunk_caps: str = "none"
    """--dpp-chunk-caps resolved: "interleaved" (each chunk held to the interleaved order's count) or "none"."""
    land_forwards: bool | None = None
    """False with --no-dpp-land-forwards (dpp-zb at v > 1); None: the policy's default."""
    weight_order: str | None = None
    """--dpp-weight-order resolved (:func:`resolve_weight_order`); None: the policy's default."""

    def as_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_inflight": self.max_inflight, "cap_factor": self.cap_factor}
        if self.chunk_caps != "none":
            out["chunk_caps"] = self.chunk_caps
        if self.fill_transit is not None:
            out["fill_transit"] = self.fill_transit
        if self.cap_basis is not None:
            out["cap_basis"] = self.cap_basis
        if self.land_forwards is not None:
            out["land_forwards"] = self.land_forwards
        if self.weight_order is not None:
            out["weight_order"] = self.weight_order
        return out


@dataclass(frozen=True)
class SchedulePlan:
    """Which schedule runs the pipeline, with which options, and why."""

    engine: Engine
    """megatron-core's schedules or this project's runtime."""
    policy: str
    """The schedule: megatron-core's 1f1b / interleaved, or the runtime's policy (trainer.schedule.registry
    name: 1f1b, interleaved, zb-h1, dpp, dpp-zb)."""
    dpp_policy: str
    """--dpp-policy with auto resolved (what the flag means for this run; "dpp" when the runtime's
    dynamic policy is not used)."""
    reason: str
    """Why this schedule runs, in words (the first log line prints it)."""
    options: PolicyOptions | None = None
    """The dynamic policy's options; None for static schedules."""
    split_backward: bool = False
    """Backwards run as I then W (zb-h1, dpp-zb): the runtime installs split backward."""
    cuda_graphs: bool = False
    """The runtime replays each chunk's block from CUDA graphs: asked for (--dpp-cuda-graphs), or
    --use-dpp's default where the graph checks find nothing (not with --dpp-eager)."""
    graphs_reason: str = ""
    """Why the graphs are on or off, in words (the first log line prints it); empty without the runtime's
    dynamic or static DPP policies under --use-dpp."""
    recompute_slots: tuple[int, ...] = ()
    """--dpp-recompute-slots, per stage from stage 0 (stages not listed: none)."""
    max_queued_ops: int = 0
    """--dpp-max-queued-ops resolved (1 with CUDA graphs, else 0 = unbounded)."""
    megatron_grad_sync: bool = False
    """megatron-core's schedule launches each chunk's DP gradient reduction (--overlap-grad-reduce under
    megatron-core's schedule: config.grad_sync_func); under the runtime the runtime starts each chunk's
    buckets after the op that completes their gradients (trainer/pipeline/grad_sync.py)."""
    runtime_param_gather: bool = False
    """--overlap-param-gather under the runtime: the runtime starts every parameter all-gather right after
    the optimizer step and waits for a chunk's before its first forward of the next step
    (trainer/pipeline/param_gather.py), megatron DDP's forward pre-hooks removed; under megatron-core's
    schedules the hooks do it."""
    held_fit: bool = False
    """--dpp-held-cap fit (auto's choice for graphed dpp-zb at one chunk per stage): the policy is built with
    the peak bound and the graph capture decides each stage's held cap from the slots' measured memory
    (trainer/pipeline/stage_graphs.py), setting the policy's cap to the slots it keeps."""
    operand_copies: str = "auto"
    """--dpp-graph-operand-copies: when a graphed split backward's slot copies W's operands out of the
    stage's backward pool (trainer/pipeline/graph_operands.py)."""
    evacuation_sets: int | None = None
    """--dpp-graph-evacuation-sets resolved: how many sets of W's operands a stage's slots share when a
    graphed split backward leaves them in the backward pool (auto: the pipeline size); None: a set per
    slot, or nothing is left in the pool (trainer/pipeline/graph_operands.py)."""
    sp_wgrad_input: str = "keep"
    """--dpp-sp-wgrad-input: what a split backward keeps for the deferred weight GEMM of a
    sequence-parallel column linear (keep the gathered input, or regather it in W)."""
    log_text: str = ""
    """The ``schedule`` field of the run's first log line: the policy (and why auto chose it), then
    whether CUDA graphs are on and why."""

    @property
    def label(self) -> str:
        """What ran the pipeline, for metrics and benchmark reports ("megatron-core 1f1b", "runtime dpp-zb")."""
        return f"{self.engine} {self.policy}"

    @property
    def policy_kwargs(self) -> dict[str, Any]:
        return self.options.as_kwargs() if self.options is not None else {}

    def recompute_slots_of(self, stage: int) -> int:
        """Graph slots of ``stage`` (of each of its chunks) that recompute the core attention."""
        return self.recompute_slots[stage] if stage < len(self.recompute_slots) else 0


@dataclass(frozen=True)
class RngPlan:
    """Which RNG state trackers the run's CUDA seeding sets up, and why."""

    graph_safe: bool = False
    """Graphed layers run (megatron-core's --cuda-graph-impl local, or the runtime's slot graphs): the
    tracker's states are ones a graph can register and replay (fresh dropout masks every replay)."""
    te_tracker: bool = False
    """Transformer Engine's tracker: asked for (--te-rng-tracker), or megatron-core's graphs capture TE's
    layers (as Megatron-LM decides)."""
    te_tracker_reason: str = ""
    """Why TE's tracker is on, in words (rank 0 logs it); empty when it is off."""


def rng_plan(cfg: TrainConfig, runtime_graphs: bool) -> RngPlan:
    """The run's RNG trackers: graph-safe where any graphs replay layers, TE's where :func:`te_rng_tracker`
    says so."""
    te_tracker, why = te_rng_tracker(cfg)
    graphs = cfg.parallel.cuda_graph_impl == "local" or runtime_graphs
    return RngPlan(graph_safe=graphs, te_tracker=te_tracker, te_tracker_reason=why)


@dataclass(frozen=True)
class LayerPlan:
    """Which transformer layers each stage and chunk holds (trainer.schedule.layers's placement, or
    trainer.schedule.stage_parts's under --pipeline-stage-layers)."""

    num_layers: int
    per_stage: tuple[float, ...]
    """Layers of each stage, all its chunks together (x.5: the stage holds half of a layer)."""
    virtual_pipeline: int
    """Model chunks per stage (v)."""
    first: int | None = None
    """--decoder-first-pipeline-num-layers."""
    last: int | None = None
    """--decoder-last-pipeline-num-layers."""
    stage_layers_flag: tuple[float, ...] = ()
    """--pipeline-stage-layers (empty: megatron-core's own placement from the flags above)."""

    @property
    def per_chunk(self) -> tuple[float, ...]:
        """Layers of each chunk, per stage (under --pipeline-stage-layers with chunks of unlike sizes,
        their mean)."""
        if self.virtual_pipeline == 1:
            return self.per_stage
        if self.stage_layers_flag:
            return tuple(layer_count(n / self.virtual_pipeline) for n in self.per_stage)
        return tuple(n // self.virtual_pipeline for n in self.per_stage)

    @property
    def splits_inside_layers(self) -> bool:
        """A stage boundary falls between a layer's attention and its MLP."""
        return splits_inside_layers(self.stage_layers_flag)

    def stage_layers(self) -> list[list[list[int]]]:
        """``[stage][chunk] -> global layer indices`` (megatron-core's placement; a layer split
        between two stages is listed on both)."""
        if self.stage_layers_flag:  # one entry per virtual stage, chunk 0 of every stage first
            held, p = whole_layers(self.stage_layers_flag), len(self.per_stage)
            return [[held[c * p + s] for c in range(self.virtual_pipeline)] for s in range(p)]
        return stage_layers(self.num_layers, len(self.per_stage), self.virtual_pipeline, self.first, self.last)

    def describe(self) -> str:
        if self.stage_layers_flag:
            return describe_stage_layers(self.stage_layers_flag)
        return describe_split(self.num_layers, len(self.per_stage), self.first, self.last)


@dataclass(frozen=True)
class LinkPlan:
    """The stage links' options (trainer.transport.factory.LinkOptions is built from them)."""

    transport: str
    """--transport (auto: shm within a node, nccl/gloo across)."""
    credits: int
    """Receive slots per channel: at least the largest in-flight cap of any stage."""
    shm_slot_bytes: int
    """Bytes per shared-memory slot."""
    timeout_s: float
    """--dpp-timeout: how long a link waits for its peer."""


@dataclass(frozen=True)
class RunPlan:
    """Everything the run decides from its configuration and world size, decided once."""

    schedule: SchedulePlan
    layers: LayerPlan
    links: LinkPlan
    world_size: int
    data_parallel: int
    num_microbatches: int
    """Microbatches per iteration per data-parallel replica at --global-batch-size: what the runtime's
    links, TP decision channel and CUDA graph slots are sized for."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    micro_batch_size: int = 1
    """--micro-batch-size: microbatches of an iteration = its global batch / (this x data_parallel)."""
    rng: RngPlan = field(default_factory=RngPlan)
    """The RNG trackers the CUDA seeding sets up (the session seeds, the model's TransformerConfig reads it)."""
    torch_optimizer_impl: str = "foreach"
    """Which torch step megatron-core's torch-fallback optimizer takes (foreach or fused;
    trainer/session/optimizer_impl.py), resolved from --torch-optimizer-impl and the device."""
    torch_optimizer_impl_reason: str = ""
    """Why, in words (the optimizer's log line)."""

    def microbatches_of(self, global_batch_size: int) -> int:
        """Microbatches per replica of an iteration of ``global_batch_size`` samples (--rampup-batch-size
        changes it between iterations; the layout checks made every size of the ramp divide)."""
        return global_batch_size // (self.micro_batch_size * self.data_parallel)

    @property
    def shape(self) -> PipelineShape:
        return PipelineShape(len(self.layers.per_stage), self.num_microbatches, self.layers.virtual_pipeline)


def resolve_plan(cfg: TrainConfig, world_size: int) -> RunPlan:
    """The plan of a run of ``cfg`` on ``world_size`` ranks; ``cfg`` must have passed the layout checks
    (trainer.config.parse_config runs them)."""
    par = cfg.parallel
    shape = PipelineShape(par.pipeline_model_parallel_size, cfg.num_microbatches(world_size), cfg.virtual_pipeline)
    pp = par.pipeline_model_parallel_size
    per_stage = tuple(layer_count(sum(par.pipeline_stage_layers[s::pp])) for s in range(pp)) \
        if par.pipeline_stage_layers else tuple(layers_per_stage(
        cfg.model.num_layers, par.pipeline_model_parallel_size, par.decoder_first_pipeline_num_layers,
        par.decoder_last_pipeline_num_layers))
    layers = LayerPlan(cfg.model.num_layers, per_stage, cfg.virtual_pipeline, par.decoder_first_pipeline_num_layers,
                       par.decoder_last_pipeline_num_layers, par.pipeline_stage_layers)
    schedule = schedule_plan(cfg)
    impl, impl_reason = resolve_torch_optimizer_impl(cfg.optim.torch_optimizer_impl, cfg.run.device)
    return RunPlan(schedule=schedule, layers=layers, links=link_plan(cfg, shape), world_size=world_size,
                   data_parallel=cfg.data_parallel(world_size), num_microbatches=shape.num_microbatches,
                   micro_batch_size=cfg.optim.micro_batch_size, rng=rng_plan(cfg, schedule.cuda_graphs),
                   torch_optimizer_impl=impl, torch_optimizer_impl_reason=impl_reason)


def uses_megatron_schedule(cfg: TrainConfig) -> bool:
    """megatron-core's own schedule runs CUDA jobs without --use-dpp, except over gloo: its P2P cannot
    send CUDA tensors through gloo, so ranks sharing a GPU run the runtime's static policy. CPU runs
    too: there megatron-core's 1F1B computes right through the CPU shims (the dist tier calls it
    directly), but its interleaved schedule does not -- with overlapped P2P (Megatron-LM's default) it
    frees each sent output while gloo may still be reading it, and at PP=2 its batched sends to the one
    peer in both directions are matched in order and swap -- while the runtime's static orders hold on
    every layout."""
    par = cfg.parallel
    return not par.use_dpp and cfg.run.device == "cuda" and par.distributed_backend != "gloo"


def resolve_cuda_graphs(cfg: TrainConfig) -> tuple[bool, str]:
    """(whether the DPP runtime replays from CUDA graphs, why). Graphs first, the policy after: auto's
    choice depends on them (:func:`resolve_dpp_policy`).

    On when asked (--dpp-cuda-graphs; its refusals are errors, :func:`graph_problems`), or by default with
    --use-dpp where the graph checks, run as if they had been asked for, find nothing: they are the
    fastest correct runtime measured (4xH200, the benchmark model, PP=4: graphed dpp-zb 415.6 ms per
    iteration against megatron-core's eager 1F1B 814.6; PP=2 728.0 against 1471.9; eager DPP runs at
    about megatron's speed). Off with --dpp-eager, or where a check blocks them (the reason names it)."""
    par = cfg.parallel
    if par.dpp_cuda_graphs:
        return True, "graphs: --dpp-cuda-graphs"
    if not par.use_dpp:
        return False, ""
    if par.dpp_eager:
        return False, "eager: --dpp-eager"
    blockers = auto_graph_problems(cfg)
    if blockers:
        return False, "eager: " + "; ".join(blockers)
    return True, "graphs: --use-dpp's default where they can run (--dpp-eager turns them off)"


def auto_graph_problems(cfg: TrainConfig) -> list[str]:
    """What would rule out CUDA graphs for ``cfg`` had --dpp-cuda-graphs been given (the default's test)."""
    asked = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dpp_cuda_graphs=True,
                                                                  dpp_eager=False))
    return _cuda_graph_problems(asked) + _recompute_slot_problems(asked)


def schedule_plan(cfg: TrainConfig) -> SchedulePlan:
    """Which schedule runs, its options and why (see :class:`SchedulePlan`)."""
    par = cfg.parallel
    graphs, graphs_why = resolve_cuda_graphs(cfg)
    dpp_policy, why = resolve_dpp_policy(cfg)
    static = "interleaved" if cfg.virtual_pipeline > 1 else "1f1b"
    common = {"dpp_policy": dpp_policy, "cuda_graphs": graphs, "graphs_reason": graphs_why,
              "sp_wgrad_input": par.dpp_sp_wgrad_input,
              "operand_copies": par.dpp_graph_operand_copies,
              "evacuation_sets": resolve_evacuation_sets(cfg, dpp_policy, graphs),
              "recompute_slots": par.dpp_recompute_slots,
              # (the layout checks hold --overlap-param-gather to the distributed optimizer)
              "runtime_param_gather": par.overlap_param_gather and not uses_megatron_schedule(cfg),
              "max_queued_ops": par.dpp_max_queued_ops if par.dpp_max_queued_ops is not None
              else 1 if graphs else 0}
    named = dpp_policy if par.dpp_policy != "auto" else f"{dpp_policy} ({why})"
    if graphs and cfg.optim.rampup is not None:
        # The slots are captured for --global-batch-size's microbatch count; an iteration of the ramp has
        # fewer microbatches, and every policy then holds no more activations than that, so it replays
        # from a subset of the same slots (a step that found none free would run eager, never wrong).
        graphs_why += ("; --rampup-batch-size: slots captured for the full batch, the ramp's smaller "
                       "iterations replay from fewer of them")
        common["graphs_reason"] = graphs_why
    if graphs_why:
        named += f"; {graphs_why}"
    if uses_megatron_schedule(cfg):
        return SchedulePlan(MEGATRON, static, reason="without --use-dpp on CUDA: megatron-core's own schedule",
                            megatron_grad_sync=par.overlap_grad_reduce, log_text="megatron-core", **common)
    if par.use_dpp and dpp_policy not in STATIC_DPP_POLICIES:
        fit = held_cap_fits(cfg, dpp_policy, graphs)
        basis = "peak" if fit else None if par.dpp_held_cap == "auto" else par.dpp_held_cap
        chunk_caps = resolve_chunk_caps(cfg, graphs)
        weight_order = resolve_weight_order(cfg, dpp_policy, graphs)
        options = PolicyOptions(par.dpp_max_inflight, par.dpp_cap_factor,
                                par.dpp_fill_transit if dpp_policy == "dpp-zb" else None, basis, chunk_caps,
                                None if par.dpp_land_forwards else False, weight_order)
        if weight_order == "youngest" and cfg.virtual_pipeline > 1 and par.dpp_weight_order == "auto":
            named += ("; the youngest deferred W first (with graphs a W right after its own I copies nothing: "
                      "--dpp-weight-order)")
        if chunk_caps != "none":
            named += ("; each chunk holds at most what the interleaved order holds in it (its CUDA graph slots: "
                      "--dpp-chunk-caps " + par.dpp_chunk_caps + ")")
        if fit:
            named += ("; held cap fitted to memory: each stage's own 1F1B bound, then slots up to stage 0's "
                      "while within the largest rank's memory (--dpp-held-cap " + par.dpp_held_cap + ")")
        return SchedulePlan(RUNTIME, dpp_policy, reason=why, options=options, held_fit=fit,
                            split_backward=dpp_policy in SPLIT_BACKWARD, log_text=named, **common)
    if dpp_policy in STATIC_DPP_POLICIES:  # a static order asked for (zb-h1 also without --use-dpp)
        return SchedulePlan(RUNTIME, dpp_policy, reason=why, split_backward=dpp_policy in SPLIT_BACKWARD,
                            log_text=named, **common)
    why_not = ("on --device cpu: megatron-core's interleaved P2P is not exact over gloo on CPU"
               if cfg.run.device != "cuda" else
               "over --distributed-backend gloo (ranks may share a GPU): megatron-core's P2P cannot send CUDA "
               "tensors through gloo")
    return SchedulePlan(RUNTIME, static, reason=f"without --use-dpp {why_not}, so the runtime's static {static} "
                        "policy stands in", log_text="1f1b policy", **common)


def resolve_weight_order(cfg: TrainConfig, dpp_policy: str, graphs: bool) -> str | None:
    """--dpp-weight-order for dpp-zb: as given, or for ``auto`` youngest at v > 1 under the slot graphs with
    lazily copied operands (sections.ParallelConfig.dpp_weight_order says why); None: the policy's own
    default (youngest at v = 1, oldest at v > 1)."""
    par = cfg.parallel
    if dpp_policy != "dpp-zb":
        return None
    if par.dpp_weight_order != "auto":
        return par.dpp_weight_order
    if cfg.virtual_pipeline > 1 and graphs and par.dpp_graph_operand_copies != "in-i":
        return "youngest"
    return None


def graphed_split_backward(cfg: TrainConfig, dpp_policy: str, graphs: bool) -> bool:
    """Whether a split backward (dpp-zb, zb-h1) runs under the CUDA graph slots."""
    return cfg.parallel.use_dpp and graphs and dpp_policy in ("dpp-zb", "zb-h1")


def lazy_operand_copies(cfg: TrainConfig, dpp_policy: str, graphs: bool) -> bool:
    """Whether a split backward runs under the CUDA graph slots leaving W's operands in the backward pool
    (--dpp-graph-operand-copies other than in-i)."""
    return graphed_split_backward(cfg, dpp_policy, graphs) and cfg.parallel.dpp_graph_operand_copies != "in-i"


ONE_CHUNK_EVACUATION_SETS = 2
"""--dpp-graph-evacuation-sets auto for dpp-zb at one chunk per stage (sections.ParallelConfig says why)."""


def resolve_evacuation_sets(cfg: TrainConfig, dpp_policy: str, graphs: bool) -> int | None:
    """--dpp-graph-evacuation-sets with auto resolved (sections.ParallelConfig.dpp_graph_evacuation_sets
    says why these counts); None: a set per slot, or no lazy copies to make."""
    choice = cfg.parallel.dpp_graph_evacuation_sets
    if not lazy_operand_copies(cfg, dpp_policy, graphs) or choice == "slots":
        return None
    if choice != "auto":
        return int(choice)
    pp = cfg.parallel.pipeline_model_parallel_size
    # dpp-zb at one chunk per stage: a W mostly follows its own I, and the memory a set would take is a slot
    # the held-cap fit can give a later stage. ZB-H1's order holds each W behind later I's by design, so every
    # one is evacuated and the last stage needs p sets to keep the order (with fewer, W's run early).
    if cfg.virtual_pipeline > 1 or dpp_policy != "dpp-zb":
        return pp
    return min(pp, ONE_CHUNK_EVACUATION_SETS)


def resolve_chunk_caps(cfg: TrainConfig, graphs: bool) -> str:
    """--dpp-chunk-caps with auto resolved: per-chunk caps where each chunk captures graph slots for what it
    may hold (graphs, two or more chunks per stage); at one chunk the stage's cap is the chunk's."""
    choice = cfg.parallel.dpp_chunk_caps
    if cfg.virtual_pipeline == 1:
        return "none"
    if choice == "auto":
        return "interleaved" if graphs else "none"
    return choice


def held_cap_fits(cfg: TrainConfig, dpp_policy: str, graphs: bool) -> bool:
    """Whether the graph capture fits each stage's held cap to memory (--dpp-held-cap fit, or auto for
    graphed dpp-zb with one chunk per stage and the caps' defaults): only slot graphs have a memory to
    measure before the first step, and only a split backward gains from holding more than 1F1B."""
    par = cfg.parallel
    if par.dpp_held_cap == "fit":
        return True
    return (par.dpp_held_cap == "auto" and dpp_policy == "dpp-zb" and fit_measurable(cfg, graphs)
            and par.dpp_max_inflight is None)


def fit_measurable(cfg: TrainConfig, graphs: bool) -> bool:
    """What the fit measures exists: slot graphs, one chunk per stage, the 1F1B bounds unscaled."""
    return graphs and cfg.virtual_pipeline == 1 and cfg.parallel.dpp_cap_factor == 1.0


def link_plan(cfg: TrainConfig, shape: PipelineShape) -> LinkPlan:
    """Credits and slot size for this run's stage links.

    Credits >= the largest in-flight activation cap of any stage: the activations (and gradients)
    waiting unconsumed on one edge never outnumber what the sending stage may hold, so a send never
    waits for a credit the policy itself withholds, whatever ``--dpp-max-inflight`` says. Slots are
    sized to one activation (seq x mbs x hidden in the pipeline dtype, seq / TP with
    ``--sequence-parallel``), so a message is one copy.
    """
    par = cfg.parallel
    cap = max(par.dpp_max_inflight or 0, scaled_cap(shape, 0, par.dpp_cap_factor))
    credits, itemsize = max(DEFAULT_LINK_CREDITS, cap), cfg.pipeline_itemsize
    if cfg.run.workload is not None:  # the prototype's per-copy share: slots of N elements (64-byte aligned)
        slot = -(-cfg.run.workload * itemsize // 64) * 64
    else:
        # --sequence-parallel: each TP rank sends its 1/TP of the sequence (its own links to its peer).
        seq = cfg.model.seq_length // (par.tensor_model_parallel_size if par.sequence_parallel else 1)
        activation = seq * cfg.optim.micro_batch_size * cfg.model.hidden_size * itemsize
        slot = max(4096, -(-activation // 4096) * 4096)
    return LinkPlan(par.transport, credits, slot, par.dpp_timeout_s)


# ---- the schedule's refusals --------------------------------------------------------------------
def schedule_problems(cfg: TrainConfig) -> list[str]:
    """Every way the schedule the flags ask for cannot run, knowable before any process group."""
    p = split_backward_refusals(cfg)
    par = cfg.parallel
    policy, policy_why = resolve_dpp_policy(cfg)
    zb = par.use_dpp and policy == "dpp-zb"
    if not par.dpp_fill_transit and not zb:
        p.append("--no-dpp-fill-transit applies to --use-dpp with dpp-zb (only it defers W); this run uses " + policy_why)
    if not par.dpp_land_forwards and not (zb and cfg.virtual_pipeline > 1 and par.dpp_fill_transit):
        p.append("--no-dpp-land-forwards applies to --use-dpp with dpp-zb, two or more model chunks per stage and "
                 f"without --no-dpp-fill-transit (there alone a forward waits for its activation to land); this run "
                 f"uses {policy_why} with {cfg.virtual_pipeline} chunk(s) per stage")
    graphs = resolve_cuda_graphs(cfg)[0]
    if par.dpp_held_cap == "fit" and not fit_measurable(cfg, graphs):
        p.append("--dpp-held-cap fit measures the CUDA graph slots' memory at one chunk per stage: it needs the "
                 "slot graphs (not --dpp-eager), no virtual pipeline and --dpp-cap-factor 1"
                 f" (this run: graphs {'on' if graphs else 'off'}, "
                 f"{cfg.virtual_pipeline} chunk(s) per stage, cap factor {par.dpp_cap_factor})")
    if par.dpp_weight_order != "auto" and not zb:
        p.append(f"--dpp-weight-order={par.dpp_weight_order} applies to --use-dpp with dpp-zb (only it defers W); "
                 f"this run uses {policy_why}")
    if par.dpp_graph_operand_copies != "auto" and not graphed_split_backward(cfg, policy, graphs):
        p.append(f"--dpp-graph-operand-copies={par.dpp_graph_operand_copies} applies to a split backward (--dpp-policy "
                 f"dpp-zb or zb-h1) under the CUDA graph slots; this run uses {policy_why}, graphs "
                 f"{'on' if graphs else 'off'}")
    if par.dpp_graph_evacuation_sets != "auto" and not lazy_operand_copies(cfg, policy, graphs):
        p.append(f"--dpp-graph-evacuation-sets={par.dpp_graph_evacuation_sets} applies to a split backward under the "
                 "CUDA graph slots that leaves W's operands in the backward pool (not --dpp-graph-operand-copies "
                 f"in-i); this run uses {policy_why}, graphs {'on' if graphs else 'off'}, operand copies "
                 f"{par.dpp_graph_operand_copies}")
    if par.dpp_sp_wgrad_input != "keep" and not (par.sequence_parallel and policy in ("dpp-zb", "zb-h1")):
        p.append(f"--dpp-sp-wgrad-input={par.dpp_sp_wgrad_input} applies to --sequence-parallel with a split "
                 "backward (--dpp-policy dpp-zb or zb-h1); this run uses " + policy_why
                 + ("" if par.sequence_parallel else " without --sequence-parallel"))
    return p


def static_order_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """--dpp-policy 1f1b / interleaved: the chunk count their order is written for, and (interleaved)
    megatron-core's rule that microbatches come in whole groups of PP (trainer.schedule.static)."""
    policy, pp = cfg.parallel.dpp_policy, cfg.parallel.pipeline_model_parallel_size
    p = []
    if policy == "1f1b" and cfg.virtual_pipeline > 1:
        p.append(f"--dpp-policy=1f1b needs one model chunk per stage, got {cfg.virtual_pipeline}: use interleaved")
    if policy == "interleaved" and cfg.virtual_pipeline < 2:
        p.append("--dpp-policy=interleaved needs two or more model chunks per stage "
                 "(--num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage)")
    o, tp = cfg.optim, cfg.parallel.tensor_model_parallel_size
    # Without --use-dpp where megatron-core's schedule does not run (CPU, gloo) the runtime's interleaved order
    # stands in for megatron-core's, with the same rule (its order cannot start otherwise).
    stand_in = (cfg.virtual_pipeline > 1 and not cfg.parallel.use_dpp and not uses_megatron_schedule(cfg)
                and policy not in STATIC_DPP_POLICIES)
    which = "--dpp-policy=interleaved" if policy == "interleaved" else \
        "the runtime's interleaved 1F1B (standing in for megatron-core's without --use-dpp here)"
    if (policy == "interleaved" or stand_in) and world_size % (tp * pp) == 0:
        per_replica = o.micro_batch_size * (world_size // (tp * pp))
        for size in o.batch_sizes:  # every size of a --rampup-batch-size ramp runs the same order
            microbatches = size // per_replica if size % per_replica == 0 else None
            if microbatches is not None and microbatches % pp:
                p.append(f"{which} needs microbatches ({microbatches}) divisible by "
                         f"--pipeline-model-parallel-size={pp} (megatron-core's interleaved 1F1B order)"
                         + (f" at global batch size {size} of --rampup-batch-size" if len(o.batch_sizes) > 1 else "")
                         + ("" if policy == "interleaved" else "; use --use-dpp or change the batch"))
    return p


def graph_problems(cfg: TrainConfig) -> list[str]:
    """What rules out the CUDA graphs asked for: the runtime's (--dpp-cuda-graphs, --dpp-recompute-slots)
    and megatron-core's (--cuda-graph-impl local)."""
    return _cuda_graph_problems(cfg) + _recompute_slot_problems(cfg) + _megatron_graph_problems(cfg)


def megatron_batch_problems(cfg: TrainConfig, microbatches: int) -> list[str]:
    """Megatron-LM's batch rule for its interleaved schedule, where the flags ask for megatron-core's
    schedule on CUDA (without --use-dpp; with gloo too, as before the plan existed)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if cfg.virtual_pipeline > 1 and not cfg.parallel.use_dpp and cfg.run.device == "cuda" and microbatches % pp:
        return [f"megatron-core's interleaved 1F1B needs microbatches ({microbatches}) divisible "
                f"by --pipeline-model-parallel-size={pp}; use --use-dpp or change the batch"]
    return []


def megatron_p2p_problems(cfg: TrainConfig) -> list[str]:
    """Megatron-LM's P2P rule for its interleaved schedule (same condition as megatron_batch_problems)."""
    par = cfg.parallel
    if cfg.virtual_pipeline > 1 and not par.overlap_p2p_comm and not par.use_dpp \
            and par.pipeline_model_parallel_size == 2 and cfg.run.device == "cuda":
        return ["--no-overlap-p2p-communication with interleaving needs --pipeline-model-parallel-size > 2 "
                "(Megatron-LM's rule: batched sends and receives between the same 2 ranks)"]
    return []


MAX_GRAPHED_LENGTHS = 32
"""--dpp-cuda-graphs with --variable-seq-lengths: most bucket lengths captured per slot (capture time
and each length's static input/output buffers grow with the count; 16 at seq 1024 / 64)."""


def _cuda_graph_problems(cfg: TrainConfig) -> list[str]:
    """What rules out --dpp-cuda-graphs (trainer/pipeline/cuda_graphs.py says why each is needed)."""
    par, m = cfg.parallel, cfg.model
    if not par.dpp_cuda_graphs:
        return []
    policy = resolve_dpp_policy(cfg)[0]
    why = {
        "--use-dpp (the graphs replace ops of the DPP runtime)": par.use_dpp,
        f"--dpp-policy dpp, dpp-zb, {', '.join(STATIC_DPP_POLICIES)} (got {par.dpp_policy}); a static order "
        "gets as many slots per chunk as it holds activations at most":
            policy in ("dpp", "dpp-zb", *STATIC_DPP_POLICIES),
        f"--device cuda (got {cfg.run.device})": cfg.run.device == "cuda",
        f"--distributed-backend nccl with --tensor-model-parallel-size {par.tensor_model_parallel_size} (the TP "
        "collectives are captured into the graphs; gloo's run on the host)":
            par.tensor_model_parallel_size == 1 or par.distributed_backend != "gloo",
        f"no recompute with dropout (got --hidden-dropout {m.hidden_dropout} --attention-dropout "
        f"{m.attention_dropout}): megatron's checkpoint keeps the graph-safe RNG state by reference, so a "
        "recomputed attention would draw a different dropout mask than its forward; set both dropouts to 0 or "
        "drop --recompute-activations / --recompute-granularity / --dpp-recompute-slots":
            (m.hidden_dropout == 0 and m.attention_dropout == 0)
            or (m.recompute is None and not any(par.dpp_recompute_slots)),
        f"at most {MAX_GRAPHED_LENGTHS} sequence lengths to capture with --variable-seq-lengths (each slot holds a "
        f"graph pair per length; --seq-length {m.seq_length} / --seq-length-divisible-by "
        f"{cfg.data.seq_length_divisible_by} gives {-(-m.seq_length // cfg.data.seq_length_divisible_by)}: "
        "raise --seq-length-divisible-by)":
            not cfg.data.variable_seq_lengths
            or -(-m.seq_length // cfg.data.seq_length_divisible_by) <= MAX_GRAPHED_LENGTHS,
    }
    return [f"--dpp-cuda-graphs needs {need}" for need, ok in why.items() if not ok]


def _recompute_slot_problems(cfg: TrainConfig) -> list[str]:
    """--dpp-recompute-slots: per-slot selective recompute inside the DPP graphs."""
    par, given = cfg.parallel, cfg.parallel.dpp_recompute_slots
    if not given:
        return []
    flag = "--dpp-recompute-slots " + ",".join(map(str, given))
    p = []
    graphs, graphs_why = resolve_cuda_graphs(cfg)
    if not graphs:
        p.append(f"{flag} needs CUDA graphs (it picks which graph slots recompute): --use-dpp's default where "
                 f"they can run, or --dpp-cuda-graphs; here {graphs_why or 'without --use-dpp'}")
    if any(n < 0 for n in given):
        p.append(f"{flag}: every count must be >= 0")
    if len(given) > par.pipeline_model_parallel_size:
        p.append(f"{flag} lists {len(given)} stages; --pipeline-model-parallel-size is "
                 f"{par.pipeline_model_parallel_size}")
    if cfg.model.recompute is not None:
        p.append(f"{flag} and --recompute-granularity {cfg.model.recompute} (or --recompute-activations): give "
                 "one (per-slot selective recompute, or recompute in every slot and eager op)")
    return p


def _megatron_graph_problems(cfg: TrainConfig) -> list[str]:
    """What rules out --cuda-graph-impl local (megatron-core's per-layer graphs for its schedules)."""
    par = cfg.parallel
    if par.cuda_graph_impl == "none":
        return []
    why = {
        "megatron-core's schedules (not --use-dpp: the DPP runtime's graphs are --dpp-cuda-graphs)":
            not par.use_dpp,
        f"--device cuda (got {cfg.run.device})": cfg.run.device == "cuda",
        "NCCL (not --distributed-backend gloo: over gloo the trainer runs its own 1f1b policy, not "
        "megatron-core's schedule, which creates the graphs)": par.distributed_backend != "gloo",
        "a fixed sequence length (not --variable-seq-lengths: graphs capture one shape)":
            not cfg.data.variable_seq_lengths,
        f"--cuda-graph-warmup-steps >= 0 (got {par.cuda_graph_warmup_steps})": par.cuda_graph_warmup_steps >= 0,
        # At PP > 1 graph creation asserted (fwd_buffer_reuse_ref_count == 0 in _create_cudagraphs) while
        # the trainer passed every microbatch the same cached causal-mask tensor; GPT's forward step now
        # passes no mask under these graphs (trainer.model.steps.causal_mask_from_attention,
        # docs/benchmarks.md): PP=2 graphed equals eager on 2xH200. BERT's mask is made per microbatch.
    }
    return [f"--cuda-graph-impl {par.cuda_graph_impl} needs {need}" for need, ok in why.items() if not ok]


def resolve_dpp_policy(cfg: TrainConfig) -> tuple[str, str]:
    """(the policy --dpp-policy names, why) -- ``auto`` resolved: dpp-zb with CUDA graphs where
    split backward is possible, else dpp. Why: on the benchmark model (4xH100, one measurement,
    equal peak memory) graphed dpp-zb ran 474.6 ms per iteration against dpp's 493.2 (510.9 vs
    519.0 with two recomputing slots), once it waits for a gradient's data rather than its header
    (fill_transit); eager it did not win (973.1 vs 953.6 at v=1, within noise), so eager runs keep dpp."""
    par = cfg.parallel
    if par.dpp_policy != "auto":
        return par.dpp_policy, "--dpp-policy " + par.dpp_policy
    if not par.use_dpp:
        return "dpp", "--dpp-policy auto without --use-dpp (not used)"
    if not resolve_cuda_graphs(cfg)[0]:
        return "dpp", "--dpp-policy auto: without CUDA graphs dpp-zb was not measured faster"
    blockers = split_backward_refusals(cfg, "dpp-zb")
    if blockers:
        return "dpp", "--dpp-policy auto: dpp-zb's split backward is ruled out: " + "; ".join(blockers)
    return "dpp-zb", ("--dpp-policy auto: with CUDA graphs dpp-zb is the faster (its later stages may hold up to "
                      "stage 0's 1F1B bound: --dpp-held-cap)")


def te_layers_named(cfg: TrainConfig) -> str | None:
    """The flag that builds the model from Transformer Engine's layer spec (as the user gave it), or None."""
    if not uses_transformer_engine_spec(cfg, installed("transformer_engine")):
        return None
    backend = cfg.model.attention
    return f"--attention-backend={backend}" if backend in TE_ATTENTION_BACKENDS else \
        f"--transformer-impl={cfg.model.transformer_impl}"


def split_backward_refusals(cfg: TrainConfig, policy: str | None = None) -> list[str]:
    """What rules out --dpp-policy dpp-zb / zb-h1 (split backward), knowable before any process group.
    ``policy``: the one to check (default: the run's, ``auto`` resolved)."""
    par = cfg.parallel
    if policy is None:
        policy = resolve_dpp_policy(cfg)[0]
    if policy not in ("dpp-zb", "zb-h1"):
        return []
    p = []
    # Transformer Engine's linears defer their weight GEMMs through TE's own deferral
    # (trainer/pipeline/split_backward_te.py), eager or graphed (trainer/pipeline/graph_operands.py).
    # "auto" picks TE on CUDA where it is installed (trainer.model.build).
    te = te_layers_named(cfg)
    if te is not None and par.sequence_parallel and par.dpp_sp_wgrad_input == "regather":
        p.append(f"--dpp-sp-wgrad-input=regather re-gathers the inputs of megatron-core's local linears in W; "
                 f"Transformer Engine's linears ({te}) keep the operands their backward gathered for their deferred "
                 "weight GEMM: drop it (keep)")
    # --sequence-parallel and --overlap-grad-reduce work: the deferred GEMM keeps (or re-gathers) its
    # gathered input, and the runtime starts the DP reduction after each chunk's last W
    # (trainer/pipeline/split_backward.py, trainer/pipeline/grad_sync.py).
    if policy == "zb-h1" and cfg.virtual_pipeline > 1:
        p.append(f"--dpp-policy=zb-h1 needs one model chunk per stage, got {cfg.virtual_pipeline}")
    if policy == "zb-h1" and not par.use_dpp and cfg.run.device == "cuda" and par.distributed_backend != "gloo":
        p.append("--dpp-policy=zb-h1 without --use-dpp on CUDA: megatron-core's own schedule would run; "
                 "add --use-dpp")
    return p
