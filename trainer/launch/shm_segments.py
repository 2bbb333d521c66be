"""Removing shared-memory segments by name: the one loop over /dev/shm that both the trainer (a run's own
token, trainer/launch/run_token.py) and the local launcher (the runs it had to kill,
trainer/launch/local_ranks.py) use. Standard library only: the launcher imports no torch."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def unlink_segments(matches: Callable[[str], bool], shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every name in ``shm_dir`` that ``matches``; the names removed. Names are unlinked, not
    unmapped (a process that has one mapped keeps using it); one another process removes first is skipped."""
    if not shm_dir.is_dir():
        return []
    removed = []
    for entry in os.scandir(shm_dir):
        if matches(entry.name):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:  # another process of the same run got there first
                continue
            removed.append(entry.name)
    return removed
