"""``python -m trainer.train``: megatron-core GPT/BERT under DP x TP x PP (x VP), optionally with DPP.

Launched by torchrun or by one srun task per rank (trainer.distributed reads either). Order matters:
the configuration is validated against the launcher's world size *before* any process group exists,
so an impossible layout exits 2 with one message naming every bad value and no traceback.

Schedules: ``--use-dpp`` runs trainer.pipeline's runtime with the greedy ``dpp`` policy. Without it,
CUDA runs use megatron-core's own ``get_forward_backward_func()`` (1F1B / interleaved 1F1B) and CPU
runs use the same runtime as DPP driven by the static ``1f1b`` (``interleaved`` for VP) policy,
because megatron's P2P communicator allocates on CUDA.
"""

# ruff: noqa: E402 (the imports after early_signals.install_for_main, on purpose)
from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer import early_signals

early_signals.install_for_main(__name__)  # before torch's import: see trainer/early_signals.py

import torch
import torch.distributed as dist

from trainer.checkpoint import (
    RunFacts,
    TrainState,
    load_checkpoint,
    preflight,
    run_identity,
    save_checkpoint,
)
from trainer.cli import EXIT_BAD_INPUT, print_error
from trainer.config import ConfigError, TrainConfig, parse_config, resolve_dpp_policy
from trainer.data.varlen import LENGTH_KEY, Bucketing, bucket_length, parse_length_distribution
from trainer.distributed import (
    LaunchError,
    LaunchInfo,
    build_topology,
    init_megatron_parallel,
    init_process_group,
    ranks_per_node_from_env,
    read_launch_env,
    shutdown,
)
from trainer.manual_gc import GcPauses, ManualGC
from trainer.model.batches import (
    BatchPlan,
    SampleSource,
    causal_mask,
    host_batch,
    mock_sample_source,
)
from trainer.model.prefetch import MicrobatchPrefetcher
from trainer.pipeline.runtime import PipelineRuntime
from trainer.pipeline.runtime import link_options as link_options  # re-exported: callers import it from here
from trainer.run_metrics import RunMeasurement
from trainer.run_token import agreed_run_token
from trainer.topology import Topology

log = logging.getLogger("trainer.train")
_PROCESS_START = time.time()  # --exit-duration-in-mins counts from here (Megatron-LM: its _TRAIN_START_TIME)

# Exit status of a rank that stopped on USR1/TERM before its last iteration (EX_TEMPFAIL: "try
# again"): never 0, so no launcher mistakes an interrupted run for a finished one.
EXIT_STOPPED = 75
# File (environment) where rank 0 records how training ended, for the sbatch script: srun's own
# status cannot tell a checkpointed stop from a crash once --kill-on-bad-exit has cut the peers.
EXIT_RECORD_ENV = "MDPP_EXIT_RECORD"


@dataclass
class TrainHooks:
    """Extension points for tests and tools (never needed for normal training)."""

    after_build: Callable[[list, Topology], None] | None = None
    """Called with the unwrapped model chunks right after construction (e.g. load reference weights)."""
    after_backward: Callable[[int, list], None] | None = None
    """Called with (iteration, DDP chunks) once the step's gradients are final, before the optimizer."""
    after_step: Callable[[int, dict[str, float]], None] | None = None
    """Called on every rank with (iteration, losses averaged over microbatches and DP) after the step."""
    forward_backward_func: Callable[..., list] | None = None
    """Replaces the schedule (e.g. a plain sequential reference loop)."""


@dataclass
class PreemptionFlag:
    """Set by SIGUSR1/SIGTERM; ranks agree on it at iteration boundaries with one tiny all-reduce."""

    raised: bool = False
    signal_name: str = ""
    previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)
        if early_signals.received:  # arrived during start-up, before this handler existed
            self.raised, self.signal_name = True, early_signals.received[-1]

    def _handle(self, signum: int, frame: Any) -> None:
        self.raised, self.signal_name = True, signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.raised else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class TrainingSession:
    """One rank's training run: set-up, the iteration loop, checkpoints, tear-down."""

    def __init__(self, cfg: TrainConfig, launch: LaunchInfo, hooks: TrainHooks) -> None:
        self.cfg, self.launch, self.hooks = cfg, launch, hooks
        self.state = TrainState()
        self.preempt = PreemptionFlag()
        self.preempt.install()  # first thing: a signal during set-up must still mean "checkpoint"
        self.stopped_with_checkpoint = False
        self.shims = None
        self.runtime: PipelineRuntime | None = None  # links, TP channel, tracer: our runtime's schedules only
        self.measure: RunMeasurement | None = None
        # Megatron-LM's per-log-interval counters: optimizer steps skipped (fp16 overflow) and, of
        # those, steps whose loss was inf/nan; printed and reset by each iteration line.
        self.skipped_iterations = self.nan_iterations = 0
        self.tensorboard = None  # --tensorboard-dir's SummaryWriter, on the logging rank only
        self.manual_gc = ManualGC.from_config(cfg.run)  # --manual-gc's collection schedule
        self.gc_pauses = GcPauses()  # collections inside steps (end-of-run log line)

    # ---- set-up ----------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, launch = self.cfg, self.launch
        preflight(cfg.checkpoint.load, cfg.checkpoint.save)  # an unreadable --load fails before any process group
        self.device = init_process_group(
            launch, cfg.run.device, timeout_s=max(600.0, cfg.parallel.dpp_timeout_s),
            backend_choice=cfg.parallel.distributed_backend,
        )
        # One token per run, agreed by all ranks: shared-memory names and every trace file carry it.
        self.run_token = agreed_run_token(device=self.device)
        if cfg.run.device == "cpu":
            from trainer.megatron_compat import apply_cpu_shims

            self.shims = apply_cpu_shims()
        elif cfg.parallel.distributed_backend == "gloo":  # CUDA tensors over gloo: ranks sharing a GPU
            from trainer.megatron_compat import apply_gloo_cuda_shims

            self.shims = apply_gloo_cuda_shims()
        par = cfg.parallel
        if par.dpp_cuda_graphs:
            from trainer.pipeline.cuda_graphs import run_on_side_stream

            self.graph_stream = run_on_side_stream(self.device)  # before the model: see its docstring
        self.topology = build_topology(launch, par.tensor_model_parallel_size,
                                       par.pipeline_model_parallel_size, cfg.virtual_pipeline)
        if cfg.run.multi_node and len(set(self.topology.node_of_rank)) < 2:
            raise LaunchError("--multi-node but every rank reported the same node (" + self.topology.describe()
                              + "): drop --multi-node, or launch on several nodes")
        init_megatron_parallel(self.topology)
        self._seed()
        self.num_microbatches = cfg.num_microbatches(launch.world_size)
        from trainer.data.split import SampleSplit

        self.split = SampleSplit.parse(cfg.sample_split)
        # Set only while validating: the global index of this evaluation step's first valid sample.
        self._eval_start: int | None = None
        self._samples_base: tuple | None = None  # (eval start, consumed samples) of _samples_of
        self._samples_of: dict[int, list] = {}
        self.samples, vocab_size = self._sample_source()
        self.prefetcher = MicrobatchPrefetcher(self._host_microbatch, self.device)
        from trainer.model import build_model_chunks, make_forward_step, wrap_ddp

        chunks = build_model_chunks(cfg, self.topology, vocab_size)
        if self.hooks.after_build is not None:
            self.hooks.after_build(chunks, self.topology)
        self.model = wrap_ddp(cfg, chunks)
        from trainer.model.steps import uses_per_token_loss

        self.forward_step = make_forward_step(
            cfg.model.model, per_token_loss=uses_per_token_loss(cfg.model.model, cfg.data.variable_seq_lengths))
        self._build_optimizer()
        self._wire_grad_sync()
        self.forward_backward = self.hooks.forward_backward_func or self._schedule()
        # --metrics-dir / --inject-stalls: wrapping the forward step reaches every schedule alike.
        self.measure = RunMeasurement(cfg, self.topology, self._schedule_label(), self.num_microbatches)
        if cfg.run.tensorboard_dir and self._is_logger:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=cfg.run.tensorboard_dir, max_queue=1000)
        self._eval_forward_step = self.forward_step  # validation stays out of the run's measurements
        self.forward_step = self.measure.wrap_forward_step(self.forward_step, self.model)
        self.padded_vocab_size = cfg.model.padded_vocab_size(vocab_size, self.topology.tensor_parallel)
        if cfg.checkpoint.load:
            loaded = load_checkpoint(cfg.checkpoint.load, self.model, self.optimizer, self.scheduler,
                                     self._checkpoint_facts(), cfg.checkpoint)
            if loaded is not None:
                self.state = loaded
        if cfg.parallel.dpp_cuda_graphs and self.runtime is not None:
            # Last in set-up: the graphs hold the parameters' storage, which a checkpoint load could replace.
            self.runtime.capture_graphs()
        self._log_layout(chunks, vocab_size)

    def _seed(self) -> None:
        # Megatron's rule: one seed per pipeline stage; TP ranks share it so CPU-initialised
        # weights are split from the same full matrix, DP replicas share it so they start equal.
        import random

        import numpy as np

        seed = self.cfg.optim.seed + 100 * self.topology.pp_rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        if self.cfg.run.device == "cuda":
            from megatron.core import tensor_parallel

            # megatron-core's graphed layers need an RNG tracker whose states a graph can replay.
            graphs = self.cfg.parallel.cuda_graph_impl == "local"
            tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graphs)

    def _sample_source(self) -> tuple[Callable[[str, int], dict], int]:
        """(split name, k) -> sample k of that split, and the vocabulary size. --data-path goes through
        megatron-core's dataset builder (its --split of documents, blends, index cache); mock data and
        --variable-seq-lengths are the project's index -> sample functions, split by index."""
        cfg = self.cfg
        m, seed = cfg.model, cfg.optim.seed
        if cfg.data.mock_data:
            lengths = (parse_length_distribution(cfg.data.mock_seq_len_dist)[0]
                       if cfg.data.variable_seq_lengths else None)
            return self._by_index(mock_sample_source(m.model, seed, m.seq_length, m.vocab_size, lengths)), m.vocab_size
        gbs = cfg.optim.global_batch_size
        train = cfg.optim.total_iters * gbs
        valid = cfg.optim.total_iters // cfg.run.eval_interval * cfg.run.eval_iters * gbs if cfg.validates else 0
        if cfg.data.tokenizer_type == "NullTokenizer":
            vocab, tokenizer = m.vocab_size, None
        else:
            from trainer.data.tokenizer import build_tokenizer

            tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.vocab_file, cfg.data.merge_file,
                                        cfg.data.tokenizer_model)
            vocab = tokenizer.vocab_size
        if not cfg.data.variable_seq_lengths:
            from trainer.data.megatron_datasets import SplitSizes, bert_samples, gpt_samples, parse_blend

            blend, split, sizes = parse_blend(cfg.data.data_path)[0], cfg.sample_split or "1,0,0", SplitSizes(train, valid)
            if m.model == "gpt":
                source = gpt_samples(blend, split, m.seq_length, seed, sizes, cfg.data.tokenizer_type, vocab,
                                     tokenizer.eod if tokenizer is not None else vocab - 1, cfg.data.data_cache_path)
            else:
                source = bert_samples(blend, split, m.seq_length, seed, sizes, tokenizer,
                                      cache_dir=cfg.data.data_cache_path)
            return source.sample, vocab
        # --variable-seq-lengths: the project's datasets, whose samples carry their real length.
        total = max(self.split.span("train", train), self.split.span("valid", valid))
        (prefix,) = cfg.data.data_path  # config allows one prefix here
        if m.model == "gpt":
            from trainer.data.gpt_dataset import GPTDocumentDataset

            dataset = GPTDocumentDataset(prefix, m.seq_length, seed, num_samples=total,
                                         pad_id=tokenizer.pad if tokenizer is not None else 0)
        else:
            from trainer.data.bert_dataset import BertSampleDataset

            dataset = BertSampleDataset(prefix, m.seq_length, tokenizer, seed, num_samples=total)
        return self._by_index(dataset.__getitem__), vocab

    def _by_index(self, source: SampleSource) -> Callable[[str, int], dict]:
        """An index -> sample function read through --split's share of sample indices (trainer/data/split.py)."""
        return lambda split, k: source(self.split.index(split, k))

    def _build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from trainer.model.build import params_dtype

        o = self.cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, clip_grad=o.clip_grad,
                            bf16=o.bf16, fp16=o.fp16, params_dtype=params_dtype(self.cfg),
                            use_distributed_optimizer=self.cfg.parallel.use_distributed_optimizer),
            self.model)
        # Steps are samples (the scheduler advances by the global batch each iteration), so
        # iteration- and sample-based settings land on the same scheduler, as in Megatron-LM.
        warmup, decay, wd_incr = o.lr_schedule_samples
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=warmup, lr_decay_steps=decay,
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=wd_incr, wd_incr_style="constant")

    def _wire_grad_sync(self) -> None:
        """The config hooks megatron's schedules read (as megatron/training/training.py sets them)."""
        from megatron.core.distributed import finalize_model_grads

        config = self.model[0].config
        no_sync = [chunk.no_sync for chunk in self.model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if self.cfg.parallel.overlap_grad_reduce and self._uses_megatron_schedule() \
                and self.hooks.forward_backward_func is None:
            # Megatron-LM's default --align-grad-reduce: megatron-core's schedules launch each chunk's
            # reduction themselves, at the same step on every pipeline stage. Our runtime has no such
            # common step (its order is dynamic): there, as in megatron-core without grad_sync_func,
            # the DDP hooks launch it during the chunk's last backward (trainer/pipeline/grad_sync.py).
            grad_sync = [chunk.start_grad_sync for chunk in self.model]
            config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    def _schedule_label(self) -> str:
        """What runs the pipeline, for metrics: megatron-core's schedule or our runtime's policy."""
        if self.hooks.forward_backward_func is not None:
            return "hook"
        if self._uses_megatron_schedule():
            return "megatron-core " + ("interleaved" if self.topology.virtual_pipeline > 1 else "1f1b")
        return f"runtime {self.runtime.context.policy.name}"

    def _uses_megatron_schedule(self) -> bool:
        """megatron-core's own schedule runs CUDA jobs without --use-dpp, except over gloo: its P2P
        cannot send CUDA tensors through gloo, so ranks sharing a GPU run our runtime's 1f1b policy."""
        par = self.cfg.parallel
        return not par.use_dpp and self.cfg.run.device == "cuda" and par.distributed_backend != "gloo"

    def _schedule(self) -> Callable[..., list]:
        if self._uses_megatron_schedule():
            from megatron.core.pipeline_parallel import get_forward_backward_func

            return get_forward_backward_func()
        runtime = PipelineRuntime(self.cfg, self.topology, self.device, self.run_token, self.num_microbatches,
                                  self.model, microbatch_data=self._microbatch,
                                  microbatch_costs=self._microbatch_costs if self.cfg.data.variable_seq_lengths
                                  else None)
        self.runtime = runtime.open()  # closes what it opened before raising, should a step fail
        return self.runtime.forward_backward

    def _checkpoint_facts(self) -> RunFacts:
        t = self.topology
        return RunFacts(layout={"world_size": t.world_size, "tp": t.tensor_parallel, "pp": t.pipeline_parallel,
                                "vp": t.virtual_pipeline},
                        padded_vocab_size=self.padded_vocab_size,
                        use_distributed_optimizer=self.cfg.parallel.use_distributed_optimizer,
                        identity=run_identity(self.cfg))

    # ---- data ------------------------------------------------------------------------------
    def _step_samples(self, microbatch: int) -> list:
        """Samples of microbatch m of this step on this DP rank: the train share of --split from
        consumed_samples on, or while validating the valid share from the evaluation step's start."""
        # Read once per step: --variable-seq-lengths asks for every microbatch's lengths at the step's
        # start (_microbatch_costs) and the prefetcher for the same samples again; on a launch-bound
        # host the second read (mock generation or index lookups, ~0.1 ms a sample) is pure loss.
        base = (self._eval_start, self.state.consumed_samples)
        if self._samples_base != base:
            self._samples_base, self._samples_of = base, {}
        if microbatch not in self._samples_of:
            topo, o = self.topology, self.cfg.optim
            plan = BatchPlan(o.micro_batch_size, topo.data_parallel, topo.dp_rank)
            if self._eval_start is None:
                samples = [self.samples("train", k) for k in plan.indices(self.state.consumed_samples, microbatch)]
            else:
                samples = [self.samples("valid", k) for k in plan.indices(self._eval_start, microbatch)]
            self._samples_of[microbatch] = samples
        return self._samples_of[microbatch]

    def _host_microbatch(self, microbatch: int) -> dict[str, torch.Tensor]:
        d = self.cfg.data
        bucketing = Bucketing(d.seq_length_divisible_by, self.cfg.model.seq_length) if d.variable_seq_lengths else None
        return host_batch(self._step_samples(microbatch), self.cfg.model.model, bucketing)

    def _microbatch_costs(self) -> list[float]:
        """This step's cost estimate per microbatch from its bucketed length (every stage of the
        pipeline reads the same samples, so all agree): (1 - a) r + a r^2 with r = length /
        --seq-length and a = 0.2 for attention's quadratic share (trainer.schedule's cost model)."""
        d = self.cfg.data
        seq = self.cfg.model.seq_length
        costs = []
        for m in range(self.num_microbatches):
            lengths = [sample[LENGTH_KEY] for sample in self._step_samples(m)]
            r = bucket_length(lengths, d.seq_length_divisible_by, seq) / seq
            costs.append(0.8 * r + 0.2 * r * r)
        return costs

    def _microbatch(self, microbatch: int, chunk: int = 0) -> dict[str, torch.Tensor]:
        """Microbatch m of this step on the device (copied ahead by the prefetcher: no host wait)."""
        batch = self.prefetcher.get(microbatch)
        if self.cfg.model.model == "gpt":
            batch = {**batch, "attention_mask": causal_mask(batch["tokens"].shape[1], self.device)}
        return batch

    def _data_iterators(self) -> list:
        """Megatron-style iterators (one per chunk) over this step's microbatches, by index. Lazy: a
        microbatch is fetched when its forward asks for it (the prefetcher keeps two ahead), so the
        schedule's first forward is queued at once instead of after all M microbatches were built
        and copied (host work added to the pipeline's fill on a launch-bound stage 0; not measured)."""
        return [(self._microbatch(m, c) for m in range(self.num_microbatches))
                for c in range(self.topology.virtual_pipeline)]

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> int:
        self.setup()
        cfg = self.cfg
        self.manual_gc.start()  # --manual-gc: automatic collection off from here (Megatron-LM's train())
        self.gc_pauses.install()
        while self.state.iteration < cfg.optim.total_iters:
            if self.preempt.agreed(self.device):
                return self._save_on_signal()
            with self.gc_pauses.in_step():
                self._train_step()
            if cfg.validates and self.state.iteration % cfg.run.eval_interval == 0:
                self.manual_gc.before_eval()
                self._evaluate()
                self.manual_gc.after_eval()
            self.manual_gc.after_iteration(self.state.iteration)  # after evaluation, before saving
            interval = cfg.checkpoint.save_interval
            saved = bool(cfg.checkpoint.save and interval and self.state.iteration % interval == 0)
            if saved:
                self._save()
            if self._exit_duration_reached():  # --exit-duration-in-mins: save (unless just saved), exit 0
                if cfg.checkpoint.save and not saved:
                    self._save()
                return 0
        if cfg.checkpoint.save and (not cfg.checkpoint.save_interval
                                    or self.state.iteration % cfg.checkpoint.save_interval):
            self._save()
        return 0

    def _exit_duration_reached(self) -> bool:
        """COLLECTIVE with --exit-duration-in-mins: Megatron-LM's check, the time since the process
        started against the limit, the longest-running rank deciding (one all-reduce per iteration)."""
        limit = self.cfg.checkpoint.exit_duration_in_mins
        if limit is None:
            return False
        minutes = (time.time() - _PROCESS_START) / 60.0
        done = torch.tensor([1.0 if minutes > limit else 0.0], device=self.device)
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item() and self.launch.rank == 0:
            log.info("exiting program after %.2f minutes (--exit-duration-in-mins %d) at iteration %d",
                     minutes, limit, self.state.iteration)
        return bool(done.item())

    def _train_step(self) -> None:
        cfg, state = self.cfg, self.state
        step = state.iteration
        self.measure.before_step(step)  # profiler start (a device sync) stays outside the timing
        start = time.perf_counter()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.prefetcher.begin_step(self.num_microbatches)  # reads state.consumed_samples: this step's data
        if self.runtime is not None:
            self.runtime.begin_step(state.iteration)
        with _sync_debug(cfg.run.cuda_sync_debug if self.device.type == "cuda" else None):
            losses = self._forward_backward()
        if self.hooks.after_backward is not None:
            self.hooks.after_backward(state.iteration, self.model)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used (logged like Megatron)
        success, grad_norm, _ = self.optimizer.step()
        if success:
            self.scheduler.step(increment=cfg.optim.global_batch_size)
        state.iteration += 1
        state.consumed_samples += cfg.optim.global_batch_size
        reduced = self._reduce_losses(losses)
        if not success:
            self.skipped_iterations += 1
            self.nan_iterations += not all(math.isfinite(v) for v in reduced.values())
        self.measure.after_step(step, time.perf_counter() - start, reduced)
        if self.hooks.after_step is not None:
            self.hooks.after_step(state.iteration, reduced)
        if self.tensorboard is not None:  # Megatron-LM's tags, every iteration
            for key, value in reduced.items():
                self.tensorboard.add_scalar(key, value, state.iteration)
            self.tensorboard.add_scalar("learning-rate", lr, state.iteration)
            self.tensorboard.add_scalar("loss-scale", float(self.optimizer.get_loss_scale()), state.iteration)
            if grad_norm is not None:
                self.tensorboard.add_scalar("grad-norm", grad_norm, state.iteration)
        if state.iteration % cfg.run.log_interval == 0 or state.iteration == cfg.optim.total_iters:
            self._log_iteration(reduced, grad_norm, lr, time.perf_counter() - start)

    def _evaluate(self) -> None:
        """Megatron-LM's evaluate: --eval-iters forward-only steps through the training schedule on
        the valid share, dropout off, no autograd. Evaluation k (at iteration k x --eval-interval)
        reads valid samples from (k - 1) x eval-iters x global batch on, as Megatron-LM's validation
        iterator would have consumed them (so a resumed run validates on the same samples)."""
        cfg, gbs = self.cfg, self.cfg.optim.global_batch_size
        first = (self.state.iteration // cfg.run.eval_interval - 1) * cfg.run.eval_iters * gbs
        losses: list = []
        for chunk in self.model:
            chunk.eval()
        try:
            with torch.no_grad():
                for step in range(cfg.run.eval_iters):
                    if step and self.runtime is not None:
                        # Forward-only steps have no optimizer step or loss reduction between them:
                        # without a barrier stage s could send step i+1's activations before stage
                        # s+1 has finished step i, whose runtime would take them for its own.
                        dist.barrier()
                    self._eval_start = first + step * gbs
                    self.prefetcher.begin_step(self.num_microbatches)
                    losses.extend(self._forward_backward(forward_only=True))
        finally:
            self._eval_start = None
            for chunk in self.model:
                chunk.train()
        self._log_validation(self._reduce_losses(losses))

    def _forward_backward(self, forward_only: bool = False) -> list:
        cfg = self.cfg
        return self.forward_backward(
            forward_step_func=self._eval_forward_step if forward_only else self.forward_step,
            # The DPP runtime fetches microbatch m by index itself; Megatron's schedules want iterators.
            data_iterator=None if self.runtime is not None else self._data_iterators(), model=self.model,
            num_microbatches=self.num_microbatches, seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.optim.micro_batch_size, decoder_seq_length=cfg.model.seq_length,
            forward_only=forward_only)

    def _reduce_losses(self, losses: list[dict]) -> dict[str, float]:
        """Mean over microbatches on the last stage, then over DP; broadcast so every rank knows.
        A [sum, tokens] value (Megatron's per-token loss report) is summed over microbatches and DP
        and reported as sum / tokens, as Megatron-LM's training loop does."""
        from megatron.core import parallel_state

        keys = sorted(losses[0]) if losses else []
        names = [None]
        last = self.topology.is_last_stage
        if last and self.topology.tp_rank == 0 and self.topology.dp_rank == 0:
            names = [keys]
        src = self.topology.rank_of(0, 0, self.topology.pipeline_parallel - 1)
        dist.broadcast_object_list(names, src=src)
        keys = names[0]
        values = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        if last:
            pairs = torch.zeros(len(keys), 2, dtype=torch.float64, device=self.device)  # (sum, count)
            for i, k in enumerate(keys):
                stacked = torch.stack([d[k].detach().double().reshape(-1) for d in losses])
                pairs[i] = stacked.sum(0) if stacked.shape[1] == 2 else torch.stack([stacked.mean(), pairs.new_ones(())])
            dist.all_reduce(pairs, group=parallel_state.get_data_parallel_group())
            values = pairs[:, 0] / pairs[:, 1].clamp(min=1)
        dist.broadcast(values, src=src)
        return {k: float(v) for k, v in zip(keys, values.tolist(), strict=True)}

    # ---- logging ---------------------------------------------------------------------------
    @property
    def _is_logger(self) -> bool:
        t = self.topology
        return t.is_last_stage and t.tp_rank == 0 and t.dp_rank == 0

    def _log_layout(self, chunks: list, vocab_size: int) -> None:
        cfg, t = self.cfg, self.topology
        params = torch.tensor([sum(p.numel() for c in chunks for p in c.parameters())], dtype=torch.float64)
        if self.cfg.run.device == "cuda":
            params = params.cuda()
        if self.launch.rank == 0 or self._is_logger:
            policy, why = resolve_dpp_policy(cfg)
            named = policy if cfg.parallel.dpp_policy != "auto" else f"{policy} ({why})"
            schedule = (named if cfg.parallel.use_dpp or policy == "zb-h1" else
                        "megatron-core" if self._uses_megatron_schedule() else "1f1b policy")
            log.info("run %s: %s %s | %s | microbatches/iter %d x mbs %d | schedule %s | "
                     "transport %s | vocab %d (padded %d) | this rank holds %.2fM parameters | "
                     "resuming at iteration %d", cfg.run.run_name, cfg.model.model.upper(),
                     f"{cfg.model.num_layers}L h{cfg.model.hidden_size}", t.describe(), self.num_microbatches,
                     cfg.optim.micro_batch_size, schedule, cfg.parallel.transport if t.pipeline_parallel > 1
                     else "none", vocab_size, cfg.model.padded_vocab_size(vocab_size, t.tensor_parallel),
                     float(params.item()) / 1e6, self.state.iteration)

    def _peak_memory_gib(self) -> float | None:
        """Largest peak of allocated GPU memory over all ranks (stage 0 usually holds the most
        activations). COLLECTIVE on CUDA; None on CPU."""
        if self.cfg.run.device != "cuda":
            return None
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak.item())

    def _log_iteration(self, losses: dict[str, float], grad_norm, lr: float, seconds: float) -> None:
        peak = self._peak_memory_gib()  # every rank takes part, so before the logger check
        skipped, nans = self.skipped_iterations, self.nan_iterations
        self.skipped_iterations = self.nan_iterations = 0
        if not self._is_logger:
            return
        cfg = self.cfg
        memory = f" | peak memory (GiB, max over ranks): {peak:.2f}" if peak is not None else ""
        tokens = cfg.optim.global_batch_size * cfg.model.seq_length
        loss_text = " | ".join(f"{k}: {v:.6E}" for k, v in losses.items())
        norm = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
        throughput = ""
        if cfg.run.log_throughput:  # where Megatron-LM puts it: right after the iteration time
            from trainer.flops import tflops_per_gpu

            tflops = tflops_per_gpu(cfg, self.padded_vocab_size, seconds, self.launch.world_size)
            throughput = f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
        loss_scale = float(self.optimizer.get_loss_scale())  # 1.0 unless --fp16's dynamic scaler
        # Megatron-LM's fields in its order; tokens/s and peak memory are this trainer's additions.
        log.info("iteration %8d/%8d | consumed samples: %10d | elapsed time per iteration (ms): %.1f |%s "
                 "learning rate: %.6E | global batch size: %5d | %s | loss scale: %.1f | grad norm: %s | "
                 "number of skipped iterations: %3d | number of nan iterations: %3d | tokens/s: %.0f%s",
                 self.state.iteration, cfg.optim.total_iters, self.state.consumed_samples, seconds * 1e3,
                 throughput, lr, cfg.optim.global_batch_size, loss_text, loss_scale, norm, skipped, nans,
                 tokens / max(seconds, 1e-9), memory)

    def _log_validation(self, losses: dict[str, float]) -> None:
        """Megatron-LM's validation report (value and PPL = exp(min(20, loss)) per loss, between
        two rules of dashes), printed by the last stage's first rank."""
        if not self._is_logger:
            return
        text = f" validation loss at iteration {self.state.iteration} | " + "".join(
            f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(20.0, v)):.6E} | " for k, v in losses.items())
        if self.tensorboard is not None:
            for key, value in losses.items():
                self.tensorboard.add_scalar(f"{key} validation", value, self.state.iteration)
                self.tensorboard.add_scalar(f"{key} validation vs samples", value, self.state.consumed_samples)
        rule = "-" * (len(text) + 1)
        for line in (rule, text, rule):
            log.info("%s", line)

    # ---- checkpoints -----------------------------------------------------------------------
    def _save(self, on_signal: bool = False) -> None:
        path = save_checkpoint(self.cfg.checkpoint.save, self.state, self.model, self.optimizer,
                               self.scheduler, self._checkpoint_facts())
        if self.launch.rank == 0:
            where = "on signal" if on_signal else f"to {path}"
            log.info("saved checkpoint at iteration %d %s", self.state.iteration, where)

    def _save_on_signal(self) -> int:
        if not self.cfg.checkpoint.save:
            if self.launch.rank == 0:
                log.warning("stopping on signal at iteration %d without a checkpoint (no --save)",
                            self.state.iteration)
            return EXIT_STOPPED
        self._save(on_signal=True)
        self.stopped_with_checkpoint = True
        return EXIT_STOPPED

    def record_exit(self, code: int) -> None:
        """Rank 0 writes how training ended to $MDPP_EXIT_RECORD: done, checkpointed or stopped + iteration."""
        path = os.environ.get(EXIT_RECORD_ENV)
        if not path or self.launch.rank != 0:
            return
        outcome = "done" if code == 0 else "checkpointed" if self.stopped_with_checkpoint else "stopped"
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as out:
            out.write(f"{outcome} {self.state.iteration}\n")
        os.replace(tmp, path)

    def flush_traces(self) -> None:
        """Best effort on a crash: write the trace this rank has so far (aggregation reads what exists)."""
        if self.runtime is not None:
            self.runtime.flush_traces()

    # ---- tear-down -------------------------------------------------------------------------
    def close(self) -> None:
        self.preempt.restore()
        self.manual_gc.stop()
        self.gc_pauses.uninstall()
        if self.state.iteration:
            log.info("stage %d: %s", self.topology.pp_rank, self.gc_pauses.summary(self.cfg.run.manual_gc))
        for c, graphs in ((self.runtime.context.graphs or {}) if self.runtime is not None else {}).items():
            log.info("stage %d chunk %d: %d training forward(s) replayed from CUDA graphs, %d eager",
                     self.topology.pp_rank, c, graphs.replayed, graphs.eager)
        context = self.runtime.context if self.runtime is not None else None
        if context is not None and context.landing_checks:
            log.info("stage %d: dpp-zb looked %d time(s) whether gradients had landed, %.3f s of host time in all",
                     self.topology.pp_rank, context.landing_checks, context.landing_check_s)
        bound = self.runtime.context.run_ahead if self.runtime is not None else None
        if bound is not None:
            log.info("stage %d: --dpp-max-queued-ops %d: the host waited %.2f s in all for its GPU before deciding",
                     self.topology.pp_rank, bound.limit, bound.total_waited_s)
        if self.cfg.parallel.cuda_graph_impl == "local":
            # megatron-core records one graph pair per layer and in-flight microbatch ("runner"); a run
            # whose layers never left eager mode would otherwise look like a graphed run in the log.
            runners = [r for chunk in self.model for mod in chunk.modules()
                       for r in getattr(getattr(mod, "cudagraph_manager", None), "cudagraph_runners", [])]
            log.info("stage %d: megatron-core CUDA graphs created for %d of %d layer runner(s)",
                     self.topology.pp_rank, sum(bool(r.cudagraph_created) for r in runners), len(runners))
        if self.measure is not None:
            self.measure.write()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.runtime is not None:  # tracer, TP channel, links, in that order
            runtime, self.runtime = self.runtime, None
            runtime.__exit__(None, None, None)
        shutdown()
        if self.shims is not None:
            self.shims.remove()
            self.shims = None


# ---- command line ------------------------------------------------------------------------------
@contextlib.contextmanager
def _sync_debug(mode: str | None):
    """``torch.cuda.set_sync_debug_mode(mode)`` for the duration of the block (None: unchanged)."""
    if mode is None:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _check_gpus_per_node(cfg: TrainConfig) -> None:
    """--num-gpus on CUDA: this node has that many GPUs (the prototype put rank r on GPU r % N)."""
    if cfg.run.num_gpus is None or cfg.run.device != "cuda" or not torch.cuda.is_available():
        return  # no CUDA: init_process_group names that problem
    if torch.cuda.device_count() < cfg.run.num_gpus:
        raise LaunchError(f"--num-gpus={cfg.run.num_gpus} GPUs per node but this node "
                          f"({os.uname().nodename}) has {torch.cuda.device_count()}")


def _world_size_from_env() -> int:
    env = os.environ
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 1


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("megatron", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")


def main(argv: Sequence[str] | None = None, hooks: TrainHooks | None = None) -> int:
    """Entry point; returns the exit code (0 all iterations done, 75 stopped on a signal, 2 bad
    configuration, 1 failure)."""
    try:
        cfg = parse_config(argv, _world_size_from_env(), ranks_per_node_from_env())
        launch = read_launch_env(node_ips=cfg.run.node_ips, num_gpus=cfg.run.num_gpus)
        _check_gpus_per_node(cfg)
    except (ConfigError, LaunchError) as err:
        print_error(str(err), "python -m trainer.train")
        return EXIT_BAD_INPUT
    _setup_logging(launch.rank)
    session = TrainingSession(cfg, launch, hooks or TrainHooks())
    try:
        code = session.run()
        # Tear-down waits on peers (end of stream on every link, group destruction). Should one
        # never answer, dump every thread's stack and exit 1 rather than hang the job.
        faulthandler.dump_traceback_later(cfg.parallel.dpp_timeout_s + 60, exit=True)
        session.close()
        faulthandler.cancel_dump_traceback_later()
        session.record_exit(code)
        return code
    except Exception:
        log.exception("rank %d failed", launch.rank)
        session.flush_traces()
        sys.stdout.flush()
        # Peers may be blocked in a collective with this rank: exiting now (non-zero) lets the
        # launcher tear the job down instead of hanging in process-group destructors.
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
