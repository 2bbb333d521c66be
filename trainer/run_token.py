"""One token per training run, identical on every rank: the single source of truth for "which run".

It names the run's shared-memory segments (two jobs on one host must never share a name, and a
segment a killed run left behind must not block the next one) and tags every trace file (so the
aggregation can refuse a folder that mixes runs).

The launcher's ids alone are not unique: torchrun without ``--standalone`` or ``--rdzv-id`` sets
TORCHELASTIC_RUN_ID to ``"none"`` for every job, and a requeued Slurm job keeps its SLURM_JOB_ID
and step id. So rank 0 draws a random suffix and broadcasts it; the launcher's id stays in front
for a human reading ``/dev/shm`` or a trace.
"""

from __future__ import annotations

import os
import secrets

import torch
import torch.distributed as dist

from trainer.names import launcher_prefix, make_token


def agreed_run_token(group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> str:
    """COLLECTIVE over ``group`` (default: the world): the run's token, the same on every rank.

    Without torch.distributed initialised (one process) the token is simply drawn here. How it is
    spelled (launcher prefix, character set, length) is trainer.names's, which also makes the
    shared-memory names from it.
    """
    suffix = secrets.randbits(32)
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend(group)
        where = device if device is not None and backend == "nccl" else torch.device("cpu")
        value = torch.tensor([suffix], dtype=torch.int64, device=where)
        source = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(value, src=source, group=group)
        suffix = int(value.item())
    return make_token(launcher_prefix(dict(os.environ)), suffix)
