"""One rank's pipeline runtime: the stage links, the TP decision channel, the tracer (with its clock
offset) and the :class:`DppContext` over them, owned by one context manager.

Why one owner: these are opened by collectives in a fixed order and hold shared memory, receiver
threads and trace files; the training session used to keep each on itself for its ``close()`` to
know about. Here they are opened in one place, in the order every rank must follow, and closed in
the reverse order -- also when opening fails halfway, so a failed set-up leaves no ring, segment or
thread behind. The training session keeps only the loop.

What it runs comes from the run plan (trainer/config/plan.py): the policy and its options, split
backward, the link options, the run-ahead bound, the recompute slots; nothing here decides from flags.

Opening order (COLLECTIVE, identical on every rank): policy and split backward (local, before any
channel exists, so an unsupported model fails cleanly), stage links (all ranks, when PP > 1), the
TP decision channel (the stage's TP group, when TP > 1), the tracer (local), the clock offset (all
ranks, when tracing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.config.plan import LinkPlan, RunPlan, link_plan, resolve_plan
from trainer.launch.topology import Topology
from trainer.names import tp_decision_name
from trainer.pipeline.dpp import DppContext, MicrobatchData, make_forward_backward_func
from trainer.schedule.core import PipelineShape
from trainer.transport.factory import LinkOptions

log = logging.getLogger(__name__)

TracerFactory = Callable[[Any, int, dict[str, Any]], Any]
"""(profile dir or None, rank, trace metadata) -> Tracer/NullTracer (trainer.profiling.tracer.make_tracer)."""


def link_options(cfg: TrainConfig, shape: PipelineShape) -> LinkOptions:
    """The stage links' options for this run (the plan's :func:`~trainer.config.plan.link_plan`)."""
    return _link_options(link_plan(cfg, shape))


def _link_options(links: LinkPlan) -> LinkOptions:
    return LinkOptions(credits=links.credits, shm_slot_bytes=links.shm_slot_bytes)


def graph_slots(policy: Any, shape: PipelineShape, stage: int) -> tuple[int, ...]:
    """CUDA graph slots per chunk of ``stage`` under ``policy``: a dynamic policy's per-chunk caps
    (--dpp-chunk-caps), else its cap (each chunk may hold up to it), or what a static order holds at most
    per chunk (its fixed order needs them all: ZB-H1 holds p activations on every stage where its 1F1B cap
    is p - s, and a forward without a free slot would run eagerly)."""
    from trainer.schedule.dynamic import one_f_one_b_cap

    held = getattr(policy, "held_per_chunk", None)
    if held is not None:
        return held(shape.num_chunks)
    chunk_caps = getattr(policy, "chunk_caps", None)
    if chunk_caps is not None:
        return tuple(min(c, policy.cap) for c in chunk_caps)
    return (getattr(policy, "cap", None) or one_f_one_b_cap(shape, stage),) * shape.num_chunks


class PipelineRuntime:
    """Context manager: ``with PipelineRuntime(...) as runtime:`` opens everything (see the module
    docstring for the order); ``runtime.forward_backward`` is called like megatron-core's schedules.
    :meth:`open` / :meth:`close` are the same two halves for an owner whose lifetime is not a block."""

    _OWNED = ("links", "tp_channel", "tracer")  # opening order; closed in reverse

    def __init__(self, cfg: TrainConfig, topology: Topology, device: torch.device, run_token: str,
                 num_microbatches: int, model: list, microbatch_data: MicrobatchData,
                 microbatch_costs: Callable[[], Sequence[float] | None] | None = None,
                 tracer_factory: TracerFactory | None = None, plan: RunPlan | None = None) -> None:
        self.cfg, self.topology, self.device, self.run_token = cfg, topology, device, run_token
        # What runs and with which options: the run plan (resolved here for callers that hold none).
        self.plan = plan if plan is not None else resolve_plan(cfg, topology.world_size)
        self.model, self.microbatch_data, self.microbatch_costs = model, microbatch_data, microbatch_costs
        self.shape = PipelineShape(topology.pipeline_parallel, num_microbatches, topology.virtual_pipeline)
        self.tracer_factory = tracer_factory
        self.links = self.tp_channel = self.tracer = None
        self.context: DppContext | None = None
        self.forward_backward: Callable[..., list] | None = None

    # ---- lifetime ------------------------------------------------------------------------------
    def __enter__(self) -> PipelineRuntime:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> PipelineRuntime:
        """Open everything in order; on any failure close what was opened, then re-raise the original error."""
        try:
            self._open()
        except BaseException:
            try:
                self.close()
            except Exception:  # the set-up error is the one to report; this one only goes to the log
                log.exception("rank %d: closing the pipeline runtime after its set-up failed also failed",
                              self.topology.rank)
            raise
        return self

    def close(self) -> None:
        """Close in reverse opening order (tracer, TP channel, links); every one is closed even if an
        earlier close raises, and the first such error is re-raised. Idempotent."""
        first: Exception | None = None
        graphs = {}
        if self.context is not None:
            graphs, self.context.graphs = self.context.graphs or {}, None
        if graphs:
            # Before the process groups go (trainer/pipeline/graph_teardown.py says why and in what order).
            from trainer.pipeline.graph_teardown import (
                CudaTeardown,
                TeardownTimeout,
                free_graphs_before_groups,
            )

            try:
                freed = free_graphs_before_groups(graphs, self.topology.rank, CudaTeardown(self.device),
                                                  self.cfg.parallel.dpp_timeout_s)
                log.info("rank %d: %d CUDA graph(s) freed before the process groups (per chunk %s)",
                         self.topology.rank, freed.total, freed.per_chunk)
            except TeardownTimeout as exc:
                first = exc
        for name in reversed(self._OWNED):
            resource = getattr(self, name)
            setattr(self, name, None)
            if resource is None:
                continue
            try:
                resource.close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def flush_traces(self) -> None:
        """Best effort on a crash: write the trace this rank has so far (aggregation reads what exists)."""
        if self.tracer is not None:
            with contextlib.suppress(Exception):
                self.tracer.close()

    def begin_step(self, iteration: int, num_microbatches: int | None = None) -> None:
        """Tag the coming step's decisions and trace events with ``iteration``; ``num_microbatches``:
        the step's count where --rampup-batch-size makes it differ from the plan's (the trace says so)."""
        self.context.iteration = iteration
        if self.tracer is not None:
            self.tracer.set_iteration(iteration)
            if num_microbatches is not None:
                self.tracer.set_microbatches(iteration, num_microbatches)

    def after_optimizer_step(self) -> None:
        """COLLECTIVE with --overlap-param-gather (every rank, right after the optimizer step): start the
        parameter all-gathers each chunk's first forward of the next step waits for
        (trainer/pipeline/param_gather.py); nothing otherwise."""
        if self.context.param_gather is not None:
            self.context.param_gather.start()

    def finish_param_gather(self) -> None:
        """With --overlap-param-gather: wait for every all-gather still pending, so every parameter
        holds the last step's update (after the last step); nothing otherwise."""
        if self.context is not None and self.context.param_gather is not None:
            self.context.param_gather.finish_all()

    # ---- opening -------------------------------------------------------------------------------
    def _open(self) -> None:
        from trainer.schedule.registry import make_policy

        cfg, topo, schedule = self.cfg, self.topology, self.plan.schedule
        name = schedule.policy
        policy = make_policy(name, self.shape, topo.pp_rank, **schedule.policy_kwargs)
        split = None
        if policy.split_backward:
            from trainer.pipeline.split_backward import install_split_backward

            # Before the links and shared-memory channels exist: an unsupported model fails cleanly.
            split = install_split_backward(self.model, sequence_parallel_input=schedule.sp_wgrad_input)
            log.info("stage %d: split backward defers the weight GEMMs of %d megatron-core linear(s) and %d "
                     "Transformer Engine linear(s) to W", topo.pp_rank, split.megatron_linears, split.te_linears)
        if topo.pipeline_parallel > 1:
            from trainer.transport.factory import make_stage_links

            links = self.plan.links
            self.links = make_stage_links(topo, links.transport, self.device, timeout_s=links.timeout_s,
                                          job_id=self.run_token, options=_link_options(links))
        if topo.tensor_parallel > 1:
            self.tp_channel = self._tp_channel()
        self.tracer = self._tracer(name)
        if self.tracer.enabled:
            from trainer.profiling.clock import measure_clock_offset

            self.tracer.set_clock_offset(measure_clock_offset())
        param_gather = None
        if schedule.runtime_param_gather:
            from trainer.pipeline.param_gather import ParamGather

            unsupported = [i for i, chunk in enumerate(self.model) if not ParamGather.supported(chunk)]
            if unsupported:
                raise ValueError(f"rank {topo.rank}: --overlap-param-gather, but model chunk(s) {unsupported} are not "
                                 "megatron DDP chunks with the distributed optimizer's overlap_param_gather")
            param_gather = ParamGather(self.model, topo.rank)  # removes megatron's forward pre-hooks
        self.context = DppContext(topology=topo, policy=policy, links=self.links,
                                  timeout_s=cfg.parallel.dpp_timeout_s, microbatch_data=self.microbatch_data,
                                  tracer=self.tracer, tp_channel=self.tp_channel, split_backward=split,
                                  gpu_timer=self._gpu_timer(), microbatch_costs=self.microbatch_costs,
                                  run_ahead=self._run_ahead(), param_gather=param_gather,
                                  policy_factory=lambda m: make_policy(name, dataclasses.replace(self.shape, num_microbatches=m),
                                                                       topo.pp_rank, **schedule.policy_kwargs),
                                  policy_microbatches=self.shape.num_microbatches)
        self.forward_backward = make_forward_backward_func(self.context)

    def _tp_channel(self):
        from megatron.core import parallel_state

        from trainer.pipeline.tp_decision import TpDecisionChannel

        topo = self.topology
        name = tp_decision_name(self.run_token, topo.pp_rank, topo.dp_rank)
        return TpDecisionChannel(name, capacity=3 * self.shape.num_microbatches * self.shape.num_chunks,
                                 is_leader=topo.tp_rank == 0,
                                 group=parallel_state.get_tensor_model_parallel_group(),
                                 description=f"stage {topo.pp_rank} rank {topo.rank} (TP rank {topo.tp_rank})")

    def _tracer(self, schedule: str):
        factory = self.tracer_factory
        if factory is None:
            from trainer.profiling.tracer import make_tracer as factory
        cfg, topo = self.cfg, self.topology
        return factory(cfg.run.profile_dir, topo.rank, {
            "stage": topo.pp_rank, "tp_rank": topo.tp_rank, "dp_rank": topo.dp_rank,
            "world_size": topo.world_size, "pipeline_parallel": topo.pipeline_parallel,
            "num_chunks": topo.virtual_pipeline, "num_microbatches": self.shape.num_microbatches,
            "schedule": schedule, "run_name": cfg.run.run_name, "run_id": self.run_token,
            # The run's layer split: the aggregation fits layer costs to the stage times with it.
            "layers_per_stage": list(self.plan.layers.per_stage)})

    def _run_ahead(self):
        """--dpp-max-queued-ops K > 0 on CUDA: the host decides only with <= K of its ops unfinished."""
        from trainer.pipeline.run_ahead import RunAheadBound

        bound = RunAheadBound.for_device(self.plan.schedule.max_queued_ops, self.topology.rank,
                                         self.cfg.parallel.dpp_timeout_s, self.device)
        return bound if bound.active else None

    def _gpu_timer(self):
        """Per-op GPU times in the trace (CUDA events) when tracing on CUDA; None otherwise."""
        if not (self.tracer.enabled and self.device.type == "cuda"):
            return None
        from trainer.profiling.gpu_spans import GpuOpTimer

        return GpuOpTimer(self.device)

    # ---- after set-up --------------------------------------------------------------------------
    def capture_graphs(self, pending_state_bytes: int = 0) -> None:
        """--dpp-cuda-graphs: one graph pair (F and B, or F, I and W with a split backward) per activation
        slot the policy may hold on this stage; with --dpp-held-cap fit, as many as fit the job's memory
        (trainer/pipeline/stage_graphs.py; ``pending_state_bytes``: the optimizer state this rank's first
        step will allocate). Call last in set-up: the graphs hold the parameters' storage, which a
        checkpoint load could replace."""
        from trainer.data.varlen import bucket_lengths
        from trainer.model.batches import causal_mask
        from trainer.model.build import params_dtype
        from trainer.pipeline.cuda_graphs import GraphShapes
        from trainer.pipeline.stage_graphs import HeldFit, capture_chunk_graphs, fit_held_slots
        from trainer.schedule.dynamic import one_f_one_b_cap

        cfg, topo, shape = self.cfg, self.topology, self.shape
        slots = graph_slots(self.context.policy, shape, topo.pp_rank)
        cap = one_f_one_b_cap(shape, topo.pp_rank)
        if hasattr(self.context.policy, "held_per_chunk") and sum(slots) > cap:
            # The static order's own need, above the 1F1B cap the dynamic policies keep to: the graph
            # log line after capture says what the extra slots reserve.
            log.info("stage %d: static %s holds up to %s activation(s) per chunk (1F1B cap %d in all): "
                     "capturing that many graph slots", topo.pp_rank, self.context.policy.name,
                     "/".join(map(str, slots)), cap)
        mbs, seq = cfg.optim.micro_batch_size, cfg.model.seq_length
        lengths = bucket_lengths(cfg.data.seq_length_divisible_by, seq) if cfg.data.variable_seq_lengths else (seq,)
        # --sequence-parallel: the block's input and output are this rank's 1/TP of the sequence.
        shards = cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1
        bert = cfg.model.model == "bert"
        shapes = GraphShapes(activation=(seq // shards, mbs, cfg.model.hidden_size), activation_dtype=params_dtype(cfg),
                             tokens=(mbs, seq), lengths=lengths, sequence_shards=shards, mask_varies=bert)
        if bert:  # the block's mask as BertModel makes it from a padding mask (here: no padding)
            from megatron.core.utils import get_attr_wrapped_model

            extend = get_attr_wrapped_model(self.model[0], "bert_extended_attention_mask")
            masks = {n: extend(torch.ones(mbs, n, dtype=torch.int64, device=self.device)) for n in lengths}
        else:
            masks = {n: causal_mask(n, self.device) for n in lengths}
        recompute_slots = self.plan.schedule.recompute_slots_of(topo.pp_rank)
        # Never more evacuation sets than slots the stage may hold (each slot's operands need one at most).
        sets = self.plan.schedule.evacuation_sets
        sets = min(sets, sum(slots)) if sets is not None else None
        fit = None
        if self.plan.schedule.held_fit:  # one chunk (the plan's rule): its own bound first, then what fits
            fit = HeldFit(own=min(cap, slots[0]), peak=slots[0], pending_bytes=pending_state_bytes,
                          gather=self._gather_every_rank, reserved=lambda: torch.cuda.memory_reserved(self.device))
            slots = (fit.own,)
        self.context.graphs = capture_chunk_graphs(self.model, shape, topo.pp_rank, slots, shapes, masks, self.device,
                                                   recompute_slots=recompute_slots,
                                                   split=self.context.split_backward,
                                                   operand_copies=self.plan.schedule.operand_copies,
                                                   evacuation_sets=sets)
        if fit is not None:
            self.context.policy.cap = fit_held_slots(self.context.graphs[0], topo.pp_rank, fit, self.device)

    def _gather_every_rank(self, value: Any) -> list[Any]:
        """``value`` of every rank of the job, in rank order; an error naming this rank and the step if a
        peer failed (the process group's timeout bounds the wait)."""
        out: list[Any] = [None] * torch.distributed.get_world_size()
        try:
            torch.distributed.all_gather_object(out, value)
        except RuntimeError as err:
            raise RuntimeError(f"rank {self.topology.rank} failed while the ranks agreed on each stage's CUDA graph "
                               f"slots (--dpp-held-cap fit, a collective with every rank): {err}") from err
        return out
