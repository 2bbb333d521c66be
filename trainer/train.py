"""``python -m trainer.train``: megatron-core GPT/BERT under DP x TP x PP (x VP), optionally with DPP.

Launched by torchrun or by one srun task per rank (trainer.launch.distributed reads either). Order matters:
the configuration is validated against the launcher's world size *before* any process group exists,
so an impossible layout exits 2 with one message naming every bad value and no traceback.

Which schedule runs, and why, is the run plan's (trainer/config/plan.py, resolved once from the
checked configuration); set-up is trainer/session/build.py, the microbatches trainer/session/
microbatches.py, the log lines trainer/session/logs.py. This module keeps the loop and the entry point.
"""

# ruff: noqa: E402 (the imports after early_signals.install_for_main, on purpose)
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.launch import early_signals

early_signals.install_for_main(__name__)  # before torch's import: see trainer/launch/early_signals.py

import torch
import torch.distributed as dist

from trainer.checkpoint.facts import RunFacts
from trainer.checkpoint.find import preflight
from trainer.checkpoint.state import TrainState, load_checkpoint, run_identity, save_checkpoint
from trainer.cli import EXIT_BAD_INPUT, print_error
from trainer.config import ConfigError, RunPlan, TrainConfig, parse_config, resolve_plan
from trainer.launch.distributed import (
    LaunchError,
    LaunchInfo,
    ranks_per_node_from_env,
    read_launch_env,
    shutdown,
)
from trainer.launch.run_token import remove_run_segments
from trainer.launch.topology import Topology
from trainer.pipeline.runtime import link_options as link_options  # re-exported: callers import it from here
from trainer.profiling.manual_gc import GcPauses, ManualGC
from trainer.profiling.memory_history import MemoryHistory
from trainer.session.build import BuiltRun, build_run
from trainer.session.optimizer_impl import pending_state_bytes, select_torch_impl

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

    def __init__(self, cfg: TrainConfig, launch: LaunchInfo, hooks: TrainHooks, plan: RunPlan | None = None) -> None:
        self.cfg, self.launch, self.hooks = cfg, launch, hooks
        self.plan = plan if plan is not None else resolve_plan(cfg, launch.world_size)
        self.state = TrainState()
        self.preempt = PreemptionFlag()
        self.preempt.install()  # first thing: a signal during set-up must still mean "checkpoint"
        self.stopped_with_checkpoint = False
        self.built: BuiltRun | None = None
        self.manual_gc = ManualGC.from_config(cfg.run)  # --manual-gc's collection schedule
        self.gc_pauses = GcPauses()  # collections inside steps (end-of-run log line)
        self.memory_history = MemoryHistory(cfg.run.record_memory_history, cfg.run.memory_snapshot_path,
                                            cfg.run.log_interval, launch.rank)

    # ---- set-up ----------------------------------------------------------------------------
    def setup(self) -> BuiltRun:
        cfg = self.cfg
        preflight(cfg.checkpoint.load, cfg.checkpoint.save)  # an unreadable --load fails before any process group
        self.memory_history.start()  # before the model is built, as Megatron-LM's model provider starts it
        self.built = run = build_run(cfg, self.plan, self.launch, self.hooks, lambda: self.state.consumed_samples)
        if cfg.checkpoint.load:
            loaded = load_checkpoint(cfg.checkpoint.load, run.model, run.optimizer, run.scheduler,
                                     self._checkpoint_facts(), cfg.checkpoint)
            if loaded is not None:
                self.state = loaded
                # The restored param groups and step counts are the saving run's: this run's step again.
                if select_torch_impl(run.optimizer, self.plan.torch_optimizer_impl):
                    log.info("optimizer: the restored state steps with torch's fused step (%s)",
                             self.plan.torch_optimizer_impl_reason)
        if self.plan.schedule.cuda_graphs and run.runtime is not None:
            # Last in set-up: the graphs hold the parameters' storage, which a checkpoint load could replace.
            run.runtime.capture_graphs(pending_state_bytes(run.optimizer))
        run.log.layout(run.chunks, run.feed.vocab_size, self.state.iteration)
        return run

    def _checkpoint_facts(self) -> RunFacts:
        t = self.built.topology
        return RunFacts(layout={"world_size": t.world_size, "tp": t.tensor_parallel, "pp": t.pipeline_parallel,
                                "vp": t.virtual_pipeline},
                        padded_vocab_size=self.built.padded_vocab_size,
                        use_distributed_optimizer=self.cfg.parallel.use_distributed_optimizer,
                        identity=run_identity(self.cfg),
                        precision="fp16" if self.cfg.optim.fp16 else "bf16" if self.cfg.optim.bf16 else "fp32")

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> int:
        code = self._train()
        if self.built.runtime is not None:
            # --overlap-param-gather: the last step's parameter all-gathers were started, never waited
            # for (as Megatron-LM's disable_forward_pre_hook at the end of train()).
            self.built.runtime.finish_param_gather()
        return code

    def _train(self) -> int:
        self.setup()
        cfg = self.cfg
        self.manual_gc.start()  # --manual-gc: automatic collection off from here (Megatron-LM's train())
        self.gc_pauses.install()
        while self.state.iteration < cfg.optim.total_iters:
            if self.preempt.agreed(self.built.device):
                return self._save_on_signal()
            with self.gc_pauses.in_step():
                self._train_step()
            self.memory_history.after_iteration(self.state.iteration)
            if cfg.validates and self.state.iteration % cfg.run.eval_interval == 0:
                self.manual_gc.before_eval()
                self._evaluate()
                self.manual_gc.after_eval()
            self.manual_gc.after_iteration(self.state.iteration)  # after evaluation, before saving
            interval = cfg.checkpoint.save_interval
            saved = bool(cfg.checkpoint.save and interval and self.state.iteration % interval == 0)
            if saved:
                self._save()
            if self._exit_duration_reached():
                # --exit-duration-in-mins: save (unless just saved) and stop. Megatron-LM exits 0 here;
                # this trainer exits EXIT_STOPPED like a signalled stop, so no launcher or chain takes
                # an unfinished run for a finished one (the exit record says "checkpointed").
                if cfg.checkpoint.save and not saved:
                    self._save()
                self.stopped_with_checkpoint = bool(cfg.checkpoint.save)
                return EXIT_STOPPED
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
        # The longest-running rank's minutes, not a flag: every rank decides on the same number, and the
        # log gives the one that decided (rank 0's own clock may still be under the limit).
        elapsed = torch.tensor([(time.time() - _PROCESS_START) / 60.0], dtype=torch.float64, device=self.built.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        minutes = elapsed.item()
        if minutes > limit and self.launch.rank == 0:
            log.info("exiting program after %.2f minutes (--exit-duration-in-mins %d, the longest-running rank) "
                     "at iteration %d", minutes, limit, self.state.iteration)
        return minutes > limit

    def _train_step(self) -> None:
        cfg, state, run = self.cfg, self.state, self.built
        step = state.iteration
        run.measure.before_step(step)  # profiler start (a device sync) stays outside the timing
        start = time.perf_counter()
        for chunk in run.model:
            chunk.zero_grad_buffer()
        run.optimizer.zero_grad()
        # --rampup-batch-size: this iteration's global batch, from the samples consumed before it
        # (Megatron-LM's update_num_microbatches at the top of each iteration); else --global-batch-size.
        batch = cfg.optim.batch_size_at(state.consumed_samples)
        microbatches = self.plan.microbatches_of(batch)
        run.feed.begin_step(microbatches)  # reads state.consumed_samples: this step's data
        if run.runtime is not None:
            run.runtime.begin_step(state.iteration, microbatches)
        with _sync_debug(cfg.run.cuda_sync_debug if run.device.type == "cuda" else None):
            losses = self._forward_backward(num_microbatches=microbatches)
        if self.hooks.after_backward is not None:
            self.hooks.after_backward(state.iteration, run.model)
        lr = run.optimizer.param_groups[0]["lr"]  # the rate this step used (logged like Megatron)
        success, grad_norm, _ = run.optimizer.step()
        if run.runtime is not None:
            # --overlap-param-gather: start the all-gathers of the updated parameter shards now, to
            # overlap whatever runs before each chunk's next forward (trainer/pipeline/param_gather.py).
            run.runtime.after_optimizer_step()
        # megatron-core returns a float, or (0.19, a CUDA run whose groups are gloo's) a one-element tensor
        grad_norm = None if grad_norm is None else float(grad_norm)
        if success:
            run.scheduler.step(increment=batch)  # the LR schedule counts samples, as Megatron-LM's
        state.iteration += 1
        state.consumed_samples += batch
        reduced = self._reduce_losses(losses)
        run.log.step_done(success, reduced)
        run.measure.after_step(step, time.perf_counter() - start, reduced, batch)
        if self.hooks.after_step is not None:
            self.hooks.after_step(state.iteration, reduced)
        loss_scale = float(run.optimizer.get_loss_scale())  # 1.0 unless --fp16's dynamic scaler
        run.log.scalars(state.iteration, reduced, lr, loss_scale, grad_norm)
        if state.iteration % cfg.run.log_interval == 0 or state.iteration == cfg.optim.total_iters:
            run.log.iteration(state.iteration, state.consumed_samples, reduced, grad_norm, lr, loss_scale,
                              time.perf_counter() - start, run.padded_vocab_size, batch)

    def _evaluate(self) -> None:
        """Megatron-LM's evaluate: --eval-iters forward-only steps through the training schedule on
        the valid share, dropout off, no autograd. Evaluation k (at iteration k x --eval-interval)
        reads valid samples from (k - 1) x eval-iters x global batch on, as Megatron-LM's validation
        iterator would have consumed them (so a resumed run validates on the same samples)."""
        cfg, run, gbs = self.cfg, self.built, self.cfg.optim.global_batch_size
        first = (self.state.iteration // cfg.run.eval_interval - 1) * cfg.run.eval_iters * gbs
        losses: list = []
        for chunk in run.model:
            chunk.eval()
        try:
            with torch.no_grad():
                for step in range(cfg.run.eval_iters):
                    if step and run.runtime is not None:
                        # Forward-only steps have no optimizer step or loss reduction between them:
                        # without a barrier stage s could send step i+1's activations before stage
                        # s+1 has finished step i, whose runtime would take them for its own.
                        dist.barrier()
                    run.feed.eval_start = first + step * gbs
                    # Megatron-LM validates with the full --global-batch-size, also during a ramp-up.
                    run.feed.begin_step(self.plan.num_microbatches)
                    losses.extend(self._forward_backward(forward_only=True, num_microbatches=self.plan.num_microbatches))
        finally:
            run.feed.eval_start = None
            for chunk in run.model:
                chunk.train()
        run.log.validation(self.state.iteration, self.state.consumed_samples, self._reduce_losses(losses))

    def _forward_backward(self, forward_only: bool = False, num_microbatches: int | None = None) -> list:
        cfg, run = self.cfg, self.built
        return run.forward_backward(
            forward_step_func=run.eval_forward_step if forward_only else run.forward_step,
            # The DPP runtime fetches microbatch m by index itself; Megatron's schedules want iterators.
            data_iterator=None if run.runtime is not None else run.feed.data_iterators(), model=run.model,
            num_microbatches=num_microbatches or self.plan.num_microbatches, seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.optim.micro_batch_size, decoder_seq_length=cfg.model.seq_length,
            forward_only=forward_only)

    def _reduce_losses(self, losses: list[dict]) -> dict[str, float]:
        """Mean over microbatches on the last stage, then over DP; broadcast so every rank knows.
        A [sum, tokens] value (Megatron's per-token loss report) is summed over microbatches and DP
        and reported as sum / tokens, as Megatron-LM's training loop does."""
        from megatron.core import parallel_state

        topology, device = self.built.topology, self.built.device
        keys = sorted(losses[0]) if losses else []
        names = [None]
        last = topology.is_last_stage
        if last and topology.tp_rank == 0 and topology.dp_rank == 0:
            names = [keys]
        src = topology.rank_of(0, 0, topology.pipeline_parallel - 1)
        dist.broadcast_object_list(names, src=src)
        keys = names[0]
        values = torch.zeros(len(keys), dtype=torch.float64, device=device)
        if last:
            pairs = torch.zeros(len(keys), 2, dtype=torch.float64, device=device)  # (sum, count)
            for i, k in enumerate(keys):
                stacked = torch.stack([d[k].detach().double().reshape(-1) for d in losses])
                pairs[i] = stacked.sum(0) if stacked.shape[1] == 2 else torch.stack([stacked.mean(), pairs.new_ones(())])
            dist.all_reduce(pairs, group=parallel_state.get_data_parallel_group())
            values = pairs[:, 0] / pairs[:, 1].clamp(min=1)
        dist.broadcast(values, src=src)
        return {k: float(v) for k, v in zip(keys, values.tolist(), strict=True)}

    # ---- checkpoints -----------------------------------------------------------------------
    def _save(self, on_signal: bool = False) -> None:
        run = self.built
        path = save_checkpoint(self.cfg.checkpoint.save, self.state, run.model, run.optimizer,
                               run.scheduler, self._checkpoint_facts())
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

    @property
    def run_token(self) -> str | None:
        """The run's token (shared-memory names, trace files), once set-up has agreed it."""
        return self.built.run_token if self.built is not None else None

    def record_failure(self, err: BaseException) -> None:
        """Rank 0 records why it failed (its node, the error's first line) in $MDPP_EXIT_RECORD: the
        sbatch script prints the record, so the job's last line names the rank that failed and, when
        a peer died (a link's error names it), that peer; srun's own line names the dead task's node."""
        path = os.environ.get(EXIT_RECORD_ENV)
        if not path or self.launch.rank != 0:
            return
        node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
        first_line = (str(err).strip().splitlines() or [""])[0][:400]
        with contextlib.suppress(OSError):
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as out:
                out.write(f"failed at iteration {self.state.iteration}: rank 0 on {node}"
                          f"{lost_peer_text(str(err), self.launch.world_size)}: {type(err).__name__}: {first_line}\n")
            os.replace(tmp, path)

    def flush_traces(self) -> None:
        """Best effort on a crash: write the trace this rank has so far (aggregation reads what exists)."""
        if self.built is not None and self.built.runtime is not None:
            self.built.runtime.flush_traces()

    # ---- tear-down -------------------------------------------------------------------------
    def _graph_groups(self) -> dict:
        """Process groups whose collectives the run's CUDA graphs captured: the tensor-parallel group
        with --dpp-cuda-graphs or --cuda-graph-impl local at TP > 1 (destroyed first, by name:
        trainer.launch.distributed.shutdown)."""
        graphed = self.plan.schedule.cuda_graphs or self.cfg.parallel.cuda_graph_impl == "local"
        if not graphed or self.built.topology.tensor_parallel == 1:
            return {}
        from megatron.core import parallel_state

        return {"tensor-parallel": parallel_state.get_tensor_model_parallel_group(check_initialized=False)}

    def close(self) -> None:
        self.preempt.restore()
        self.manual_gc.stop()
        self.gc_pauses.uninstall()
        self.memory_history.stop()
        run = self.built
        stage = run.topology.pp_rank
        if self.state.iteration:
            log.info("stage %d: %s", stage, self.gc_pauses.summary(self.cfg.run.manual_gc))
        context = run.runtime.context if run.runtime is not None else None
        chunk_graphs = (context.graphs or {}) if context is not None else {}
        for c, graphs in chunk_graphs.items():
            log.info("stage %d chunk %d: %d training forward(s) replayed from CUDA graphs, %d eager",
                     stage, c, graphs.replayed, graphs.eager)
        # the stage's chunks share one backward pool, and its state
        pools = {id(g.pool_state): g.pool_state for g in chunk_graphs.values() if getattr(g, "pool_state", None)}
        for pool in pools.values():
            if pool.direct or pool.evacuated or pool.early:
                log.info("stage %d: graphed split backward: %d W(s) read their operands where I left them, %d slot "
                         "evacuation(s) copied them out of the backward pool first, %d W(s) ran early (every "
                         "evacuation set taken)", stage, pool.direct, pool.evacuated, pool.early)
        split = context.split_backward if context is not None else None
        if split is not None and split.te_linears:
            log.info("stage %d: split backward: %d Transformer Engine weight GEMM(s) deferred to W, %d run in their "
                     "backward (no I open)", stage, split.te_deferred, split.te_at_once)
        if context is not None and context.landing_checks:
            log.info("stage %d: dpp-zb looked %d time(s) whether inputs had landed, %.3f s of host time in all",
                     stage, context.landing_checks, context.landing_check_s)
        bound = context.run_ahead if context is not None else None
        if bound is not None:
            log.info("stage %d: --dpp-max-queued-ops %d: the host waited %.2f s in all for its GPU before deciding",
                     stage, bound.limit, bound.total_waited_s)
        if self.cfg.parallel.cuda_graph_impl == "local":
            # megatron-core records one graph pair per layer and in-flight microbatch ("runner"); a run
            # whose layers never left eager mode would otherwise look like a graphed run in the log.
            runners = [r for chunk in run.model for mod in chunk.modules()
                       for r in getattr(getattr(mod, "cudagraph_manager", None), "cudagraph_runners", [])]
            log.info("stage %d: megatron-core CUDA graphs created for %d of %d layer runner(s)",
                     stage, sum(bool(r.cudagraph_created) for r in runners), len(runners))
        run.measure.write()
        run.log.close()
        graph_groups = self._graph_groups()  # read while megatron's parallel state still exists
        if self.cfg.parallel.cuda_graph_impl == "local" and run.device.type == "cuda":
            from trainer.pipeline.graph_teardown import free_megatron_graphs

            torch.cuda.synchronize(run.device)  # a graph is released only once its replays have run
            log.info("stage %d: %d megatron-core CUDA graph(s) freed before the process groups",
                     stage, free_megatron_graphs(run.model))
        if run.runtime is not None:  # graphs freed, then tracer, TP channel, links, in that order
            runtime, run.runtime = run.runtime, None
            runtime.__exit__(None, None, None)
        shutdown(self.launch.rank, graph_groups)
        if run.shims is not None:
            run.shims.remove()
            run.shims = None


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


LOST_CONNECTION = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                   "remote process exited", "Connection refused")
"""What gloo's and NCCL's collectives say when the process at the other end is gone (their messages name
an address, not a rank)."""


def lost_peer_text(message: str, world_size: int) -> str:
    """For rank 0's failure record: where a collective lost its connection to a peer (a rank killed, out of
    memory, its node gone), which ranks it can have been -- every other rank; srun's own line names the
    task that died. A link of the runtime names its peer itself, so only collectives need this."""
    if world_size < 2 or not any(s in message for s in LOST_CONNECTION):
        return ""
    others = list(range(1, world_size))
    who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others[0]}-{others[-1]}"
    return f", which lost its connection to {who} in a collective"


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
        remove_run_segments(session.run_token)  # the run's last act (trainer.launch.run_token)
        session.record_exit(code)
        return code
    except Exception as err:
        log.exception("rank %d failed", launch.rank)
        session.record_failure(err)  # the job's last line names the failure (trainer/train.py: record_failure)
        session.flush_traces()
        remove_run_segments(session.run_token)  # the run's last act (trainer.launch.run_token)
        sys.stdout.flush()
        # Peers may be blocked in a collective with this rank: exiting now (non-zero) lets the
        # launcher tear the job down instead of hanging in process-group destructors.
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
