"""One token per training run, identical on every rank: the single source of truth for "which run".

It names the run's shared-memory segments (two jobs on one host must never share a name, and a
segment a killed run left behind must not block the next one) and tags every trace file (so the
aggregation can refuse a folder that mixes runs).

The launcher's ids alone are not unique: torchrun without ``--standalone`` or ``--rdzv-id`` sets
TORCHELASTIC_RUN_ID to ``"none"`` for every job, and a requeued Slurm job keeps its SLURM_JOB_ID
and step id. So rank 0 draws a random suffix and broadcasts it; the launcher's id stays in front
for a human reading ``/dev/shm`` or a trace.

A caller that runs many jobs on one host may put a tag of its own in front (RUN_TAG_ENV): the test
suite does, so that it can tell its own runs' segments from those of any other run on the host.

Removing what is left: segments exist only while links are being set up (each is unlinked once both
ends mapped it), but a rank killed in that window cannot unlink its own. Every rank of the run knows
the token, so :func:`remove_run_segments` is how a survivor (the transport when set-up fails, the
trainer as its last act) removes whatever ``/dev/shm/mdpp-<token>-*`` remains on its host: this
run's names only, never another run's (docs/transport.md, "Shared-memory hygiene").
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.launch.shm_segments import SHM_DIR, unlink_segments
from trainer.names import RUN_TAG_ENV, is_segment_of, job_name_part, make_token, token_prefix

__all__ = ["RUN_TAG_ENV", "SHM_DIR", "agreed_run_token", "remove_run_segments", "token_prefix"]

log = logging.getLogger(__name__)



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
    return make_token(token_prefix(dict(os.environ)), suffix)


def remove_run_segments(token: str | None, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every segment of the run ``token`` still in ``shm_dir``; the names removed.

    Safe to call from any rank, any number of times, at any point after set-up began: names are
    unlinked, not unmapped, so a rank that still has a segment mapped keeps using it. A name another
    process removes first is skipped. None (no token drawn yet): nothing to do."""
    if not token:
        return []
    job = job_name_part(token)
    removed = unlink_segments(lambda name: is_segment_of(job, name), shm_dir)
    if removed:
        log.warning("removed %d shared-memory segment(s) run %s left in %s: %s",
                    len(removed), token, shm_dir, ", ".join(sorted(removed)))
    return removed
