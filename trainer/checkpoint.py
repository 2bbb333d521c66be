"""Per-rank checkpoints, written atomically, and resume.

Layout under ``--save DIR``::

    DIR/iter_0000020/rank_00003.pt   model chunks + optimizer + LR scheduler + RNG + counters
    DIR/latest                       "20" -- written LAST, by rank 0, with tmp file + os.replace

Every rank writes into ``iter_0000020.tmp/``; after a barrier rank 0 renames the folder and then
points ``latest`` at it, so a crash at any moment leaves either the previous complete checkpoint
or the new complete one, never a half-written one that ``--load`` would pick up. ``DIR`` must be
visible to all ranks (a shared file system on multi-node jobs, as Megatron also assumes).

Saved RNG state (Python, NumPy, torch CPU and, on GPUs, CUDA + megatron's tracker) makes a resumed
run draw the same dropout masks as the uninterrupted one; data is addressed by consumed samples.
The distributed optimizer shards its state and needs megatron's dist-checkpointing: not supported
here yet (refused with a clear error rather than saving something that cannot be resumed).
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

log = logging.getLogger(__name__)
LATEST = "latest"


@dataclass
class TrainState:
    """Counters that must survive a restart."""

    iteration: int = 0
    consumed_samples: int = 0


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank:05d}.pt"


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_identity(cfg) -> dict[str, object]:
    """What a resumed run must share with its checkpoint: model shape, seed, LR schedule, batch.

    A run resumed with another seed or learning rate would quietly carry on with the checkpoint's
    optimizer and scheduler state (the issue-15 case trained at learning rate 0); train_iters counts
    only through the decay length it sets, so extending a run with --lr-decay-iters fixed is allowed.
    """
    m, o = cfg.model, cfg.optim
    return {
        "model": m.model, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads, "ffn_hidden_size": m.ffn_size, "seq_length": m.seq_length,
        "seed": o.seed, "lr": o.lr, "min_lr": o.min_lr, "lr_warmup_iters": o.lr_warmup_iters,
        "lr_decay_style": o.lr_decay_style, "lr_decay_iters": o.decay_iters, "weight_decay": o.weight_decay,
        # The schedule in the scheduler's own units, whichever flags set it (sample-based training and
        # --lr-warmup-fraction included); checkpoints older than these keys skip them.
        "lr_warmup_samples": o.lr_schedule_samples[0], "lr_decay_samples": o.lr_schedule_samples[1],
        "optimizer": o.optimizer, "micro_batch_size": o.micro_batch_size, "global_batch_size": o.global_batch_size,
    }


def identity_differences(saved: dict[str, object], current: dict[str, object]) -> list[str]:
    """'name: checkpoint X, this run Y' for every setting that differs (keys missing on either side skipped)."""
    return [f"{key}: checkpoint {saved[key]!r}, this run {current[key]!r}"
            for key in current if key in saved and saved[key] != current[key]]


def save_checkpoint(root: str, state: TrainState, model: list, optimizer, scheduler,
                    layout: dict[str, int], use_distributed_optimizer: bool,
                    identity: dict[str, object] | None = None) -> Path:
    """COLLECTIVE: every rank writes its file; returns the final folder."""
    if use_distributed_optimizer:
        raise NotImplementedError("--save with --use-distributed-optimizer is not supported yet")
    rank = dist.get_rank()
    final = _iter_dir(Path(root), state.iteration)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    dist.barrier()
    payload = {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "layout": layout,
        "identity": identity or {},
        "model": [chunk.state_dict() for chunk in model],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
    }
    torch.save(payload, _rank_file(tmp, rank))
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(Path(root) / LATEST, f"{state.iteration}\n")
    dist.barrier()
    return final


def latest_iteration(root: str | None) -> int | None:
    """Iteration named by ``root/latest``, or None for a missing/empty directory (start fresh)."""
    if not root:
        return None
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer}: expected an iteration number, found {text!r}")
    return int(text)


def load_checkpoint(root: str, model: list, optimizer, scheduler, layout: dict[str, int],
                    identity: dict[str, object] | None = None, override: bool = False) -> TrainState | None:
    """Restore this rank's state from ``root``; None when there is nothing to resume.

    ValueError when the checkpoint's :func:`run_identity` differs from ``identity`` (unless ``override``).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = _rank_file(_iter_dir(Path(root), iteration), dist.get_rank())
    if not path.is_file():
        raise FileNotFoundError(f"{root}/latest names iteration {iteration} but {path} is missing")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload["layout"] != layout:
        raise ValueError(f"checkpoint {path} was saved with layout {payload['layout']}, this run has {layout}")
    differences = identity_differences(payload.get("identity", {}), identity or {})
    if differences and not override:
        raise ValueError(f"checkpoint {path.parent} belongs to a run with other settings ({'; '.join(differences)}): "
                         "resume with the same settings, save to a new folder, or pass --override-checkpoint-config")
    if differences:
        log.warning("resuming %s despite other settings (--override-checkpoint-config): %s",
                    path.parent, "; ".join(differences))
    for chunk, sd in zip(model, payload["model"], strict=True):
        chunk.load_state_dict(sd)
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    _set_rng_state(payload["rng"])
    log.info("resumed from %s (iteration %d)", path.parent, iteration)
    return TrainState(payload["iteration"], payload["consumed_samples"])
