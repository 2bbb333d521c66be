"""Checks `workflows.submit` makes before anything is submitted: what only the login node's
filesystem or the cluster itself can tell (ChainSpec checks the values on their own).

Each returns problems as strings naming the value, so the driver prints them all in one line and
exits 2 — rather than a chain that pends forever (more nodes than the partition has) or fails on
the compute nodes (an image that is not there).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from workflows import slurm

log = logging.getLogger(__name__)

SQUASHFS_SUFFIXES = (".sqsh", ".squashfs")


def image_problems(image: str | None) -> list[str]:
    """A local image (what Pyxis takes as a file: a path starting with / or ., or a .sqsh name) must exist.

    Registry references (``nvcr.io#nvidia/pytorch:24.07-py3``, ``ubuntu:22.04``) are the cluster's to
    resolve and are not checked.
    """
    if not image:
        return []
    looks_local = image.startswith(("/", ".", "~")) or image.endswith(SQUASHFS_SUFFIXES)
    if not looks_local:
        return []
    path = Path(image).expanduser()
    if path.is_file():
        return []
    what = "is a directory, not a squashfs file" if path.is_dir() else "no such file"
    return [f"--image {image}: {what} (build one with containers/build.sh, or containers/build-offline.sh"
            " for the CPU image, or name a registry image such as nvcr.io#nvidia/pytorch:24.07-py3)"]


def partition_problems(nodes: int, partition: str | None) -> list[str]:
    """``nodes`` must fit the partition (its node count and MaxNodes); an unknown partition is named.

    Skipped when Slurm's commands are not on PATH or scontrol fails: submitting then fails with
    Slurm's own message (a cluster problem, not bad input).
    """
    if shutil.which("scontrol") is None:
        return []
    try:
        partitions = slurm.partitions()
    except slurm.SlurmError as exc:
        log.warning("could not check --nodes against the partition: %s", exc)
        return []
    if partition is None:
        chosen = next((p for p in partitions if p.default), None)
        if chosen is None:
            return []  # no default partition: sbatch will say so
    else:
        chosen = next((p for p in partitions if p.name == partition), None)
        if chosen is None:
            known = ", ".join(p.name for p in partitions) or "none"
            return [f"--partition {partition}: no such partition (this cluster has: {known})"]
    limit = chosen.node_limit
    if nodes > limit:
        why = (f"has {chosen.total_nodes} node(s)" if limit == chosen.total_nodes
               else f"allows at most {limit} node(s) per job (MaxNodes)")
        return [f"--nodes {nodes}: partition {chosen.name} {why}; the job would pend forever"]
    return []


def runs_dir_problems(runs_dir: Path) -> list[str]:
    """``--runs-dir`` must be a folder this user can create run folders in (or can create)."""
    existing = runs_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"--runs-dir {runs_dir}: {existing} is a file, not a folder"]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == runs_dir else f"cannot be created: {existing} is not writable"
        return [f"--runs-dir {runs_dir}: {what} by this user (pass another --runs-dir)"]
    return []
