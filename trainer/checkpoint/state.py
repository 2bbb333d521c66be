"""Checkpoints through megatron-core's distributed checkpointing, in Megatron-LM's directory layout.

Layout under ``--save DIR`` (what Megatron-LM writes with ``--ckpt-format torch_dist``)::

    DIR/latest_checkpointed_iteration.txt   "20": Megatron-LM's tracker, written LAST by rank 0
    DIR/iter_0000020/                       one megatron.core.dist_checkpointing checkpoint:
        metadata.json                       backend (torch_dist) and version
        common.pt                           rank 0's non-sharded state: iteration, scheduler, run identity
                                            (megatron-core 0.16; 0.19 writes no common.pt: its
                                            load_common_state_dict reads the .distcp files)
        .metadata, __<rank>_<n>.distcp      torch.distributed.checkpoint shards of every tensor

Tensors are saved under megatron-core's ``sharded_state_dict`` keys, which are global: a layer is
stored at its global layer number and a TP shard at its offset in the full matrix, so a checkpoint
saved under one TP x PP (x VP) layout loads under another, and the DPP runtime's chunks (built by
megatron-core, layers keep their global ``layer_number``) save and load like megatron's own. Keys
follow Megatron-LM's ``generate_state_dict``: ``model`` (``model0``, ``model1``, ... with virtual
pipeline chunks), ``optimizer``, ``opt_param_scheduler``, ``rng_state``, ``iteration``,
``checkpoint_version``; this trainer's own counters and run identity sit under ``mdpp``.

The distributed optimizer is saved in megatron-core's ``fully_reshardable`` form (its state in
model-parameter shape, gathered over DP), the form that survives a TP/PP change; the plain optimizer's
state is sharded like the parameters. RNG states (Python, NumPy, torch CPU and, on GPUs, CUDA +
megatron's tracker) are one object per (PP, TP) rank holding every DP rank's state; they are restored
only when the layout is unchanged (the same rule as Megatron-LM), so a resumed run draws the same
dropout masks as the uninterrupted one. Data is addressed by consumed samples.

A save writes ``iter_0000020.tmp/`` first; after a barrier rank 0 renames it and then rewrites the
tracker (tmp file + ``os.replace``), so a crash at any moment leaves the previous complete checkpoint
or the new complete one. ``DIR`` must be visible to all ranks (a shared file system on multi-node jobs,
as Megatron also assumes).

Saves and loads never hang: each runs under a deadline (trainer/checkpoint/watchdog.py; 30 minutes,
``$MDPP_CHECKPOINT_TIMEOUT_S`` or the ``timeout_s`` argument) past which the rank reports the
iteration, the folder and the phase it waited in (``SAVE_*``/``LOAD_*`` below) and exits 1. An
unfinished save leaves ``iter_N.tmp/`` and the tracker naming the previous checkpoint, which a
resume takes; the next save removes every such leftover.

Finding the checkpoint to resume and what ``--load`` refuses: trainer/checkpoint/find.py.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.checkpoint.facts import RunFacts
from trainer.checkpoint.find import (
    FORMAT,
    MEGATRON_LM_FORMAT,
    TRACKER,
    CheckpointError,
    find_checkpoint,
    iteration_dir,
    read_common_state,
    remove_leftovers,
)
from trainer.checkpoint.megatron_lm import megatron_lm_loads
from trainer.checkpoint.watchdog import Watchdog
from trainer.config import llama_identity
from trainer.launch.early_signals import kept_from_child_processes

log = logging.getLogger(__name__)
MEGATRON_CHECKPOINT_VERSION = 3.0  # what Megatron-LM writes as 'checkpoint_version'


@dataclass
class TrainState:
    """Counters that must survive a restart."""

    iteration: int = 0
    consumed_samples: int = 0


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- what a run must share with its checkpoint -------------------------------------------------
def run_identity(cfg) -> dict[str, object]:
    """What a resumed run must share with its checkpoint: model shape, seed, LR schedule, batch.

    A run resumed with another seed or learning rate would quietly carry on with the checkpoint's
    optimizer and scheduler state (a resumed run was seen training at learning rate 0); train_iters counts
    only through the decay length it sets, so extending a run with --lr-decay-iters fixed is allowed.
    The parallel layout is not part of it: checkpoints load under any TP x PP layout.
    """
    m, o = cfg.model, cfg.optim
    identity = {
        "model": m.model, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads, "ffn_hidden_size": m.ffn_size, "seq_length": m.seq_length,
        "seed": o.seed, "lr": o.lr, "min_lr": o.min_lr, "lr_warmup_iters": o.lr_warmup_iters,
        "lr_decay_style": o.lr_decay_style, "lr_decay_iters": o.decay_iters, "weight_decay": o.weight_decay,
        # The schedule in the scheduler's own units, whichever flags set it (sample-based training and
        # --lr-warmup-fraction included); checkpoints older than these keys skip them.
        "lr_warmup_samples": o.lr_schedule_samples[0], "lr_decay_samples": o.lr_schedule_samples[1],
        "optimizer": o.optimizer, "micro_batch_size": o.micro_batch_size, "global_batch_size": o.global_batch_size,
        # The batch sizes still to come depend on it (the consumed samples resume the ramp).
        "rampup_batch_size": list(o.rampup_batch_size) if o.rampup_batch_size is not None else None,
        **llama_identity(m),  # the Llama-family architecture flags (RMSNorm, SwiGLU, RoPE, groups, biases)
    }
    if o.train_samples is not None:
        # Sample-based training: the decay is lr_decay_samples; the iteration count is only how many
        # batches --train-samples makes, so a longer --train-samples resumes (as Megatron-LM's).
        del identity["lr_decay_iters"]
    return identity


def identity_differences(saved: dict[str, object], current: dict[str, object]) -> list[str]:
    """'name: checkpoint X, this run Y' for every setting that differs (keys missing on either side skipped)."""
    return [f"{key}: checkpoint {saved[key]!r}, this run {current[key]!r}"
            for key in current if key in saved and saved[key] != current[key]]


# ---- the sharded state dict ---------------------------------------------------------------------
def _sharding_metadata(use_distributed_optimizer: bool, saved: dict[str, Any] | None = None) -> dict[str, Any]:
    """megatron-core's sharded_state_dict switches, as Megatron-LM sets them for torch_dist.

    ``fully_reshardable``: the distributed optimizer's state in model-parameter shape (gathered over
    DP at save), the only form that loads under another TP/PP; Megatron-LM's default,
    ``dp_reshardable``, reshards over DP only. The DP group is named as Megatron-LM names it (newer
    megatron-core reads it from here rather than from parallel_state). A fresh dict per call.
    ``saved``: the switches a Megatron-LM checkpoint was written with (its content metadata), which a
    load must use to find its tensors, as Megatron-LM's loader does.
    """
    from megatron.core import parallel_state as ps

    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if saved is not None:
        metadata.update(saved)
    elif use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return metadata


def _model_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def _materialize_adam_state(optimizer) -> None:
    """Give every parameter of a torch Adam/AdamW that has not stepped yet the state its first step
    would create (step 0, zero moments): the same optimizer, written down.

    Without Apex or Transformer Engine (CPU runs) megatron-core drives torch's own Adam, whose state
    appears only at the first step; the distributed optimizer's ``state_dict`` then fails on a fresh
    optimizer (it reads every parameter's ``step``: a save at iteration 0, and every load, which builds
    the state dict to load into), and a plain optimizer saved at iteration 0 lacks the moments a load
    asks for. Fused Adams (TE, Apex) are left alone: megatron-core handles them; torch's own with
    ``fused=True`` get their step where that step keeps it.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if state:
                    continue
                # torch's own initial value: on the parameter's device for a fused (or capturable) step.
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _zero_steps_where_unsaved(optimizer, loaded: Any) -> None:
    """Give a loaded torch Adam/AdamW state saved before the first step its step (0) back.

    megatron-core stores the plain optimizer's shared step only when it is non-zero (``if step:``), so
    the moments of a checkpoint saved at iteration 0 (a signal during start-up) come back without a
    ``step``, which torch's Adam refuses; 0 is what they were saved with.
    """
    live = getattr(optimizer, "chained_optimizers", [optimizer])
    saved = [loaded] if len(live) == 1 else [loaded[k] for k in sorted(loaded)] if isinstance(loaded, dict) \
        else list(loaded)
    for sub, sub_state in zip(live, saved, strict=True):
        # FP32Optimizer: torch's own {'state', 'param_groups'}; Float16Optimizer: under 'optimizer'.
        inner_state = sub_state.get("optimizer", sub_state) if isinstance(sub_state, dict) else None
        state = inner_state.get("state") if isinstance(inner_state, dict) else None
        if type(getattr(sub, "optimizer", None)) not in (torch.optim.Adam, torch.optim.AdamW) \
                or not isinstance(state, dict) or "common_step" in state:
            continue
        if any(isinstance(s, dict) and s and "step" not in s for s in state.values()):
            state["common_step"] = torch.tensor(0.0)


def _sharded_state_dict(model: list, optimizer, use_distributed_optimizer: bool, is_loading: bool,
                        saved_sharding: dict[str, Any] | None = None) -> dict:
    """``saved_sharding``: a Megatron-LM checkpoint's sharding switches (see :func:`_sharding_metadata`)."""
    from megatron.core.utils import unwrap_model

    _materialize_adam_state(optimizer)
    chunks = unwrap_model(model)
    state: dict[str, Any] = {_model_key(i, len(chunks)): chunk.sharded_state_dict(
        metadata=_sharding_metadata(use_distributed_optimizer, saved_sharding)) for i, chunk in enumerate(chunks)}
    # The optimizer's state is keyed by the model tensors' global keys (it looks the parameters up
    # in ``state``), so it reshards with them.
    from trainer.megatron.compat import fully_reshardable_bucket_offsets

    with fully_reshardable_bucket_offsets():
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_sharding_metadata(use_distributed_optimizer, saved_sharding))
    return state


def _rng_state() -> dict[str, Any]:
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        # With CUDA graphs the tracker is megatron's graph-safe one, whose states are generator objects:
        # saved as state tensors, so a checkpoint loads into either kind of tracker.
        state["rng_tracker_states"] = {name: tensor_parallel.convert_cuda_rng_state(s, to_graphable=False)
                                       for name, s in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda_rng_state"])
        tracker = tensor_parallel.get_cuda_rng_tracker()
        graph_safe = getattr(tracker, "use_cudagraphable_rng", False)  # as Megatron-LM's checkpoint loader does
        tracker.set_states({name: tensor_parallel.convert_cuda_rng_state(s, to_graphable=graph_safe)
                            for name, s in state["rng_tracker_states"].items()})


def _rng_sharded_object():
    """COLLECTIVE over DP: this (PP, TP) rank's object holding every DP rank's RNG state."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedObject

    group = ps.get_data_parallel_group()
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, _rng_state(), group=group)
    return ShardedObject("rng_state", states,
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank())


# ---- save -----------------------------------------------------------------------------------------
# The phases a save reports when it overruns its deadline (trainer/checkpoint/watchdog.py).
SAVE_START = "waiting for the other ranks to begin the save"
SAVE_COLLECT = "collecting the state"
SAVE_PLAN = "planning the save with the other ranks"
SAVE_WRITE = "writing shards"
SAVE_WAIT = "waiting for the other ranks to finish writing"
SAVE_FINALISE = "finalising"
SAVE_DONE = "waiting for the other ranks to finish the save"
SAVE_COMMIT = "finalising: rename and tracker"
SAVE_END = "waiting for rank 0 to rename the folder and write the tracker"


def sync_overlapped_params(model: list) -> None:
    """COLLECTIVE under --overlap-param-gather: finish every parameter all-gather now (the last step's
    would otherwise wait for the next forward), so the weights saved are the updated ones on every
    rank -- what Megatron-LM's disable_forward_pre_hook does before it saves."""
    for chunk in model:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def save_checkpoint(root: str, state: TrainState, model: list, optimizer, scheduler, facts: RunFacts,
                    timeout_s: float | None = None) -> Path:
    """COLLECTIVE: write ``root/iter_N`` through megatron-core, then the tracker; returns the folder.

    Bounded: a rank whose save has not finished ``timeout_s`` after it began (default:
    :func:`~trainer.checkpoint.watchdog.checkpoint_timeout_s`) reports the iteration, the folder and
    the phase it waited in and exits 1; the tracker still names the previous checkpoint.
    """
    final = iteration_dir(root, state.iteration)
    tmp = final.with_name(final.name + ".tmp")
    sync_overlapped_params(model)
    with Watchdog("save", dist.get_rank(), tmp, state.iteration, timeout_s) as watchdog:
        _save(root, state, model, optimizer, scheduler, facts, watchdog)
    return final


def _save(root: str, state: TrainState, model: list, optimizer, scheduler, facts: RunFacts,
          watchdog: Watchdog) -> None:
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = iteration_dir(root, state.iteration)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        remove_leftovers(Path(root))
        tmp.mkdir(parents=True)
    watchdog.enter(SAVE_START, "barrier: rank 0 prepares the folder")
    dist.barrier()
    watchdog.enter(SAVE_COLLECT, "model and optimizer sharded state, RNG states all-gathered over DP")
    sharded = _sharded_state_dict(model, optimizer, facts.use_distributed_optimizer, is_loading=False)
    sharded.update({
        "iteration": state.iteration,
        "checkpoint_version": MEGATRON_CHECKPOINT_VERSION,
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": _rng_sharded_object(),
        "mdpp": {"format": FORMAT, "consumed_samples": state.consumed_samples, "layout": facts.layout,
                 "padded_vocab_size": facts.padded_vocab_size, "identity": facts.identity,
                 "use_distributed_optimizer": facts.use_distributed_optimizer},
    })
    _write_results_in_process()
    with kept_from_child_processes():  # its writer processes must survive Slurm's signals (see there)
        watchdog.enter(SAVE_PLAN, "megatron-core: sharding validation, common.pt, save plan; collectives")
        request = dist_checkpointing.save(sharded, str(tmp), validate_access_integrity=True,
                                          async_sharded_save=True, **_builtin_async_strategy(dist_checkpointing.save))
        _write_in_phases(request, watchdog)
    watchdog.enter(SAVE_DONE, "barrier after megatron-core's save")
    dist.barrier()
    if rank == 0:
        watchdog.enter(SAVE_COMMIT, f"renaming {tmp.name} to {final.name}, then writing {TRACKER}")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(Path(root) / TRACKER, f"{state.iteration}\n")  # LAST: names complete checkpoints only
    watchdog.enter(SAVE_END, "barrier")
    dist.barrier()


def _write_results_in_process() -> None:
    """Give megatron-core's writer an in-process queue for its results instead of a Manager's.

    Its ``FileSystemWriterAsync`` passes the write results back through a queue that lives in a
    spawned multiprocessing Manager (a second Python per rank, started by the first save): made for
    a write running in a background process, which this trainer never does (:func:`_write_in_phases`
    runs it in the rank). That Manager was the weak part of every save: Slurm's TERM to the step
    killed it (it was spawned with TERM unblocked: see early_signals.kept_from_child_processes), so
    the on-signal save after a periodic one died with BrokenPipeError/EOFError; it outlived a rank
    killed with ``kill -9``; and it spent seconds importing this trainer's main module before the
    first save could begin, time a preempted job does not have (KillWait). With the results kept in
    the rank no second Python exists. Versions of megatron-core without the module-level queue keep
    their Manager, still started under ``kept_from_child_processes``."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:  # megatron-core 0.16: created on first use
        filesystem_async._results_queue = queue.Queue()


def _builtin_async_strategy(save) -> dict:
    """megatron-core's own writer for the request: from 0.19 ``save(..., async_sharded_save=True)``
    defaults to ``async_strategy="nvrx"``, which needs nvidia-resiliency-ext (not installed, and not
    what megatron-core's synchronous save uses: that is ``"mcore"``); 0.16 has no such argument.
    Found on 4xH100 with 0.19.2: "A compatible `nvidia-resiliency-ext` installation is required"."""
    import inspect

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(save).parameters else {}


def _write_in_phases(request, watchdog: Watchdog) -> None:
    """megatron-core's synchronous save, run from its request so the watchdog can tell the phases apart.

    ``dist_checkpointing.save(..., async_sharded_save=True)`` returns what its synchronous path would
    then run (``AsyncRequest.execute_sync``: the write, a barrier, the finalize functions: gathering
    the ranks' write results, rank 0 writing .metadata and metadata.json, a barrier); running it here
    runs the same steps in the same order (megatron-core 0.16 and 0.19 alike), only with the phase
    marked where the write ends (the barrier that follows waits for the other ranks) and where the
    finalisation begins.
    """
    def write(*args, **kwargs) -> None:
        request.async_fn(*args, **kwargs)
        watchdog.enter(SAVE_WAIT, "megatron-core's barrier after the write")

    def finalising() -> None:
        watchdog.enter(SAVE_FINALISE, "megatron-core gathers the write results, rank 0 writes .metadata "
                                      "and metadata.json; collectives")

    watchdog.enter(SAVE_WRITE, "megatron-core's writer and the worker processes it forks")
    if request.async_fn is None:  # nothing to write on this rank
        watchdog.enter(SAVE_WAIT, "megatron-core's barrier after the write")
    request._replace(async_fn=write if request.async_fn is not None else None,
                     finalize_fns=[finalising, *request.finalize_fns]).execute_sync()


# ---- load -----------------------------------------------------------------------------------------
# The phases a load reports when it overruns its deadline (trainer/checkpoint/watchdog.py).
LOAD_FIND = "reading the tracker and the common state"
LOAD_COLLECT = "collecting the state to load into"
LOAD_READ = "reading shards"
LOAD_RESTORE = "restoring the state"


# run_identity's keys that belong to the LR scheduler's state: not compared when it is not loaded
# (--finetune, --no-load-optim) or its values are chosen by flag (--override-opt_param-scheduler,
# --use-checkpoint-opt_param-scheduler); with --finetune only the model's shape must match.
SCHEDULE_KEYS = frozenset({"lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "weight_decay",
                           "lr_warmup_samples", "lr_decay_samples"})
TRAINING_KEYS = SCHEDULE_KEYS | {"seed", "optimizer", "micro_batch_size", "global_batch_size", "rampup_batch_size"}


def _compared_identity(identity: dict[str, object], options) -> dict[str, object]:
    if options is None:
        return identity
    skip: frozenset[str] = frozenset()
    if options.finetune:
        skip = TRAINING_KEYS
    elif options.no_load_optim or options.override_opt_param_scheduler or options.use_checkpoint_opt_param_scheduler:
        skip = SCHEDULE_KEYS
    return {k: v for k, v in identity.items() if k not in skip}


def load_checkpoint(root: str, model: list, optimizer, scheduler, facts: RunFacts,
                    options=None, timeout_s: float | None = None) -> TrainState | None:
    """Restore the state ``root``'s tracker names; None when there is nothing to resume (fresh start).

    ``options``: the run's CheckpointConfig (Megatron-LM's --finetune, --no-load-optim, --no-load-rng,
    --override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler; --override-checkpoint-config),
    or a bool standing for --override-checkpoint-config alone.
    ValueError when the checkpoint's :func:`run_identity` differs from ``facts.identity`` in what this
    load restores (unless --override-checkpoint-config); :class:`CheckpointError` for a checkpoint this
    run cannot read. Bounded like :func:`save_checkpoint` (``timeout_s``): a rank still loading past it
    reports and exits 1.
    """
    if isinstance(options, bool) or options is None:
        override, options = bool(options), None
    else:
        override = options.override_checkpoint_config
    with Watchdog("load", dist.get_rank(), Path(root), None, timeout_s) as watchdog:
        return _load(root, model, optimizer, scheduler, facts, override, watchdog, options)


def _check_identity(path: Path, saved: dict[str, Any], facts: RunFacts, options, override: bool,
                    model_only: bool) -> None:
    """ValueError naming every setting the checkpoint's run had otherwise (unless overridden);
    ``model_only``: a Megatron-LM checkpoint, whose args are compared for the model's shape only."""
    compared = _compared_identity(facts.identity, options)
    if model_only:  # only the model's shape: Megatron-LM's args carry no schedule this trainer compares
        compared = {k: v for k, v in compared.items() if k not in TRAINING_KEYS}
    differences = identity_differences(saved.get("identity", {}), compared)
    if differences and not override:
        raise ValueError(f"checkpoint {path} belongs to a run with other settings ({'; '.join(differences)}): "
                         "resume with the same settings, save to a new folder, take the LR schedule from this command "
                         "line (--override-opt_param-scheduler) or the checkpoint (--use-checkpoint-opt_param-scheduler), "
                         "load only the weights (--finetune), or pass --override-checkpoint-config")
    if differences:
        log.warning("resuming %s despite other settings (--override-checkpoint-config): %s",
                    path, "; ".join(differences))


def _load(root: str, model: list, optimizer, scheduler, facts: RunFacts, override: bool,
          watchdog: Watchdog, options=None) -> TrainState | None:
    from megatron.core import dist_checkpointing

    watchdog.enter(LOAD_FIND, f"files under {root}")
    found = find_checkpoint(root)
    if found is None:
        return None
    iteration, path = found
    watchdog.folder, watchdog.iteration = path, iteration
    common = read_common_state(path)
    saved = common["mdpp"]
    foreign = saved["format"] == MEGATRON_LM_FORMAT
    _check_identity(path, saved, facts, options, override, model_only=foreign)
    if saved["padded_vocab_size"] is not None and saved["padded_vocab_size"] != facts.padded_vocab_size:
        raise CheckpointError(
            f"{path} holds an embedding padded to {saved['padded_vocab_size']} rows, this run pads the vocabulary to "
            f"{facts.padded_vocab_size} (--make-vocab-size-divisible-by x TP): pick a "
            "--make-vocab-size-divisible-by that gives the checkpoint's size under this TP")
    if not foreign and saved["use_distributed_optimizer"] != facts.use_distributed_optimizer:
        with_or_without = "with" if saved["use_distributed_optimizer"] else "without"
        raise CheckpointError(f"{path} was saved {with_or_without} --use-distributed-optimizer: resume {with_or_without} "
                              "it (the optimizer state is stored in that optimizer's form)")
    same_layout = saved["layout"] == facts.layout
    loads_optimizer = options is None or options.loads_optimizer
    loads_rng = same_layout and (options is None or options.loads_rng)
    if foreign:
        loads_optimizer, loads_rng = megatron_lm_loads(path, saved, facts, options)
    watchdog.enter(LOAD_COLLECT, "model and optimizer sharded state, RNG states all-gathered over DP")
    sharded = _sharded_state_dict(model, optimizer, facts.use_distributed_optimizer, is_loading=True,
                                  saved_sharding=saved["megatron_lm"]["sharding"] if foreign else None)
    if not loads_optimizer:
        del sharded["optimizer"]  # not read at all (Megatron-LM: --finetune / --no-load-optim)
    if loads_rng:
        sharded["rng_state"] = _rng_sharded_object()
    # raise_unexpected: a tensor this run needs that the checkpoint lacks is an error naming the key
    # before anything is read (not a half-loaded model).
    with kept_from_child_processes():
        watchdog.enter(LOAD_READ, "megatron-core's load: file reads and collectives")
        loaded = dist_checkpointing.load(sharded, str(path), strict="raise_unexpected")
    watchdog.enter(LOAD_RESTORE, "into the model, optimizer, scheduler and RNGs")
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(model)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(chunks))], strict=True)
    from trainer.megatron.compat import torch_adam_distributed_optimizer_load

    if loads_optimizer:
        _zero_steps_where_unsaved(optimizer, loaded["optimizer"])
        # no_grad: megatron-core 0.16 copies a dp_reshardable state (Megatron-LM's default form) into the
        # fp32 main parameters outside no_grad; in an fp32 run those are views of the model's parameters,
        # and the in-place copy then fails ("a view of a leaf Variable that requires grad").
        with torch.no_grad(), torch_adam_distributed_optimizer_load(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
        if options is not None and (options.override_opt_param_scheduler or options.use_checkpoint_opt_param_scheduler):
            # megatron-core's own switches, read by its load_state_dict: this run's values, or the
            # checkpoint's, for every schedule setting (the step count is loaded either way).
            scheduler.override_opt_param_scheduler = options.override_opt_param_scheduler
            scheduler.use_checkpoint_opt_param_scheduler = options.use_checkpoint_opt_param_scheduler
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if not loads_optimizer and hasattr(optimizer, "reload_model_params"):
        # The fp32 main weights were copied from the freshly initialised model when the optimizer was
        # built: copy the loaded weights in instead (Megatron-LM's reload_model_params).
        optimizer.reload_model_params()
    if loads_rng:
        from megatron.core import parallel_state as ps

        states = loaded["rng_state"]
        # This trainer's: every DP rank's state. Megatron-LM's: one (its DP rank 0's, which every DP rank
        # takes), or every DP rank's with --data-parallel-random-init.
        _set_rng_state(states[ps.get_data_parallel_rank()] if len(states) > 1 else states[0])
    elif not same_layout and not foreign and dist.get_rank() == 0:
        log.info("checkpoint %s was saved with layout %s, this run has %s: weights, optimizer and scheduler "
                 "resharded; RNG states not restored (as in Megatron-LM)", path, saved["layout"], facts.layout)
    if options is not None and options.finetune:
        log.info("loaded the model weights of %s (iteration %d) for --finetune: training starts at iteration 0",
                 path, iteration)
        return TrainState(0, 0)
    log.info("resumed from %s (iteration %d)%s", path, iteration,
             "" if loads_optimizer else " without its optimizer and LR scheduler state (--no-load-optim)")
    return TrainState(int(loaded["iteration"]), int(saved["consumed_samples"]))
