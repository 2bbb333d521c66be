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
import re
import secrets

import torch
import torch.distributed as dist

MAX_LENGTH = 40
"""Segment names derive from the token; keep them well under NAME_MAX."""


def launcher_prefix(env: dict[str, str] | None = None) -> str:
    """What the launcher says about the job: Slurm job[.step][-rRESTART], else torchrun's run id."""
    env = dict(os.environ) if env is None else env
    if env.get("SLURM_JOB_ID"):
        prefix = env["SLURM_JOB_ID"]
        if env.get("SLURM_STEP_ID"):  # two steps of one allocation may overlap
            prefix += f".{env['SLURM_STEP_ID']}"
        if env.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):
            prefix += f"-r{env['SLURM_RESTART_COUNT']}"
        return prefix
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return "" if run_id in ("", "none") else run_id  # "none": torchrun's default, shared by every job


def make_token(prefix: str, suffix: int) -> str:
    """``prefix-suffix`` with only [A-Za-z0-9_.-], at most MAX_LENGTH characters (the suffix kept)."""
    tail = f"{suffix & 0xFFFFFFFF:08x}"
    head = re.sub(r"[^A-Za-z0-9_.]", "_", prefix)[: MAX_LENGTH - len(tail) - 1]
    return f"{head}-{tail}" if head else tail


def agreed_run_token(group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> str:
    """COLLECTIVE over ``group`` (default: the world): the run's token, the same on every rank.

    Without torch.distributed initialised (one process) the token is simply drawn here.
    """
    suffix = secrets.randbits(32)
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend(group)
        where = device if device is not None and backend == "nccl" else torch.device("cpu")
        value = torch.tensor([suffix], dtype=torch.int64, device=where)
        source = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(value, src=source, group=group)
        suffix = int(value.item())
    return make_token(launcher_prefix(), suffix)
