"""Building one rank's training run: process group, topology, data feed, model, optimizer, schedule,
measurements and log, in the order every rank must follow -- returned as one :class:`BuiltRun`.

What runs the pipeline is the run plan's (trainer/config/plan.py): megatron-core's
``get_forward_backward_func()`` or the pipeline runtime with the plan's policy.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import RngPlan, RunPlan, SchedulePlan, TrainConfig
from trainer.config.plan import MEGATRON
from trainer.launch.distributed import (
    LaunchError,
    LaunchInfo,
    build_topology,
    init_megatron_parallel,
    init_process_group,
)
from trainer.launch.run_token import agreed_run_token
from trainer.launch.topology import Topology
from trainer.measure.run_metrics import RunMeasurement
from trainer.pipeline.runtime import PipelineRuntime
from trainer.session.logs import RunLog
from trainer.session.microbatches import MicrobatchFeed

log = logging.getLogger(__name__)


@dataclass
class BuiltRun:
    """Everything one rank's run holds once set up."""

    plan: RunPlan
    device: torch.device
    run_token: str
    """Agreed by all ranks: shared-memory names and every trace file carry it."""
    topology: Topology
    feed: MicrobatchFeed
    chunks: list
    """The unwrapped model chunks (the first log line counts their parameters)."""
    model: list
    """The DDP-wrapped chunks the schedules and the optimizer work on."""
    optimizer: Any
    scheduler: Any
    forward_step: Callable
    """The forward step of training, measured (--metrics-dir, --inject-stalls)."""
    eval_forward_step: Callable
    """The forward step of validation (out of the run's measurements)."""
    forward_backward: Callable[..., list]
    runtime: PipelineRuntime | None
    """The pipeline runtime (links, TP channel, tracer) when the plan's engine is the runtime."""
    measure: RunMeasurement
    log: RunLog
    padded_vocab_size: int
    shims: Any = None
    """megatron-core's CPU / gloo-on-CUDA shims, removed at close."""
    graph_stream: Any = None
    """--dpp-cuda-graphs: the side stream the model runs on (trainer.pipeline.cuda_graphs)."""


def build_run(cfg: TrainConfig, plan: RunPlan, launch: LaunchInfo, hooks: Any,
              consumed_samples: Callable[[], int]) -> BuiltRun:
    """Set up this rank's run (COLLECTIVE: every rank calls it). ``hooks``: trainer.train.TrainHooks;
    ``consumed_samples``: the training state's count at the time of asking (a resumed run replaces
    the state object after set-up, so the feed must not hold the one it was built with)."""
    from trainer.megatron.jit import import_megatron_core

    import_megatron_core()  # first: megatron-core's fused kernels then import no TorchDynamo (see there)
    device = init_process_group(launch, cfg.run.device, timeout_s=max(600.0, cfg.parallel.dpp_timeout_s),
                                backend_choice=cfg.parallel.distributed_backend)
    with waiting_for_every_rank(launch.rank, "agreeing on the run token"):
        run_token = agreed_run_token(device=device)
    shims = None
    if cfg.run.device == "cpu":
        from trainer.megatron.compat import apply_cpu_shims

        shims = apply_cpu_shims()
    elif cfg.parallel.distributed_backend == "gloo":  # CUDA tensors over gloo: ranks sharing a GPU
        from trainer.megatron.compat import apply_gloo_cuda_shims

        shims = apply_gloo_cuda_shims()
    graph_stream = None
    if plan.schedule.cuda_graphs:
        from trainer.pipeline.cuda_graphs import run_on_side_stream

        graph_stream = run_on_side_stream(device)  # before the model: see its docstring
    par = cfg.parallel
    with waiting_for_every_rank(launch.rank, "gathering every rank's node"):
        topology = build_topology(launch, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                  plan.layers.virtual_pipeline)
    if cfg.run.multi_node and len(set(topology.node_of_rank)) < 2:
        raise LaunchError("--multi-node but every rank reported the same node (" + topology.describe()
                          + "): drop --multi-node, or launch on several nodes")
    with waiting_for_every_rank(launch.rank, "building megatron-core's process groups"):
        init_megatron_parallel(topology)
    _seed(cfg, topology, plan.rng)
    feed = MicrobatchFeed(cfg, topology, device, plan.num_microbatches, consumed_samples)
    from trainer.model import build_model_chunks, make_forward_step, wrap_ddp
    from trainer.model.steps import uses_per_token_loss

    chunks = build_model_chunks(cfg, topology, feed.vocab_size, plan.rng)
    if hooks.after_build is not None:
        hooks.after_build(chunks, topology)
    # Our runtime starts the overlapped DP reduction itself (trainer/pipeline/grad_sync.py).
    model = wrap_ddp(cfg, chunks, runtime_launches_reduction=plan.schedule.engine != MEGATRON
                     and hooks.forward_backward_func is None)
    forward_step = make_forward_step(
        cfg.model.model, per_token_loss=uses_per_token_loss(cfg.model.model, cfg.data.variable_seq_lengths))
    if cfg.parallel.cuda_graph_impl == "local" and cfg.model.model == "gpt":
        from trainer.model.steps import causal_mask_from_attention

        # One cached mask tensor shared by every microbatch's layer graphs broke megatron-core's graph
        # creation at PP > 1; without a mask its causal attention applies its own (docs/benchmarks.md).
        forward_step = causal_mask_from_attention(forward_step)
    optimizer, scheduler = _optimizer(cfg, plan, model)
    wire_grad_sync(model, optimizer, plan.schedule, scheduled_by_hook=hooks.forward_backward_func is not None)
    runtime = None
    if hooks.forward_backward_func is not None:
        forward_backward, label = hooks.forward_backward_func, "hook"
    elif plan.schedule.engine == MEGATRON:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward, label = get_forward_backward_func(), plan.schedule.label
    else:
        runtime = PipelineRuntime(cfg, topology, device, run_token, plan.num_microbatches, model,
                                  microbatch_data=feed.microbatch,
                                  microbatch_costs=feed.costs if cfg.data.variable_seq_lengths else None, plan=plan)
        runtime.open()  # closes what it opened before raising, should a step fail
        forward_backward, label = runtime.forward_backward, plan.schedule.label
    try:
        # --metrics-dir / --inject-stalls: wrapping the forward step reaches every schedule alike.
        measure = RunMeasurement(cfg, topology, label, plan.num_microbatches, plan.layers.per_stage)
        log = RunLog(cfg, plan, topology, launch.rank, device)
        return BuiltRun(plan=plan, device=device, run_token=run_token, topology=topology, feed=feed, chunks=chunks,
                        model=model, optimizer=optimizer, scheduler=scheduler,
                        forward_step=measure.wrap_forward_step(forward_step, model), eval_forward_step=forward_step,
                        forward_backward=forward_backward, runtime=runtime, measure=measure, log=log,
                        padded_vocab_size=cfg.model.padded_vocab_size(feed.vocab_size, topology.tensor_parallel),
                        shims=shims, graph_stream=graph_stream)
    except BaseException:
        if runtime is not None:  # what the trace has so far, as on any crash after the runtime opened
            runtime.flush_traces()
        raise


class SetupCollectiveError(RuntimeError):
    """A collective of the set-up broke: the message names the rank and the step it waited in."""


@contextlib.contextmanager
def waiting_for_every_rank(rank: int, step: str) -> Iterator[None]:
    """Name the set-up step whose collective (one every rank joins) failed on this rank. A peer that
    died there or failed before it breaks the collective at once (gloo: connection reset; the store:
    connection closed), or after the process group's timeout; either way the error, raised from
    torch's, says who waited for what, where torch's names only a socket."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, (SetupCollectiveError, LaunchError)):
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise SetupCollectiveError(
            f"rank {rank} failed during set-up while {step} (a collective with every rank): {first} -- a "
            "peer that died or failed before it breaks it; the first rank to fail says why in its log") from err


def _seed(cfg: TrainConfig, topology: Topology, rng: RngPlan) -> None:
    # Megatron's rule: one seed per pipeline stage; TP ranks share it so CPU-initialised
    # weights are split from the same full matrix, DP replicas share it so they start equal.
    import random

    import numpy as np

    seed = cfg.optim.seed + 100 * topology.pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if cfg.run.device == "cuda":
        from megatron.core import tensor_parallel

        if rng.te_tracker and topology.rank == 0:
            log.info("RNG: Transformer Engine's tracker (%s)", rng.te_tracker_reason)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=rng.te_tracker,
                                                        use_cudagraphable_rng=rng.graph_safe)


def _optimizer(cfg: TrainConfig, plan: RunPlan, model: list) -> tuple[Any, Any]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from trainer.model.build import params_dtype
    from trainer.session.optimizer_impl import select_torch_impl

    o = cfg.optim
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, clip_grad=o.clip_grad,
                        bf16=o.bf16, fp16=o.fp16, params_dtype=params_dtype(cfg),
                        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer),
        model)
    fused = select_torch_impl(optimizer, plan.torch_optimizer_impl)
    if fused:
        log.info("optimizer: torch's fused step in %d param group(s) (%s)", fused, plan.torch_optimizer_impl_reason)
    # Steps are samples (the scheduler advances by the global batch each iteration), so
    # iteration- and sample-based settings land on the same scheduler, as in Megatron-LM.
    warmup, decay, wd_incr = o.lr_schedule_samples
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=wd_incr, wd_incr_style="constant")
    return optimizer, scheduler


def wire_grad_sync(model: list, optimizer: Any, schedule: SchedulePlan, scheduled_by_hook: bool = False) -> None:
    """The config hooks megatron's schedules read (as megatron/training/training.py sets them)."""
    from megatron.core.distributed import finalize_model_grads

    config = model[0].config
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if schedule.megatron_grad_sync and not scheduled_by_hook:
        # Megatron-LM's default --align-grad-reduce: megatron-core's schedules launch each chunk's
        # reduction themselves, at the same step on every pipeline stage. Our runtime has no such
        # common step (its order is dynamic): it starts each chunk's buckets right after the op
        # that completes their gradients (trainer/pipeline/grad_sync.py).
        grad_sync = [chunk.start_grad_sync for chunk in model]
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
