"""Megatron-LM's ``--record-memory-history`` / ``--memory-snapshot-path``: the CUDA caching allocator's
history (every allocation and free with its Python stack, torch.cuda.memory._record_memory_history) and
snapshots of it, readable at https://pytorch.org/memory_viz or with
``python -m trainer.profiling.memory_summary FILE``.

As Megatron-LM: recording starts before the model is built; a snapshot is written after iteration 1
and every --log-interval iterations, and one named ``oom_rank-<R>_<name>`` when an allocation fails.
Unlike Megatron-LM, which writes the last rank's only, every rank writes its own
(``<stem>_rank<R><suffix>``): a pipeline's stages hold different layers, so each has its own peak."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_PATH = "snapshot.pickle"
"""Megatron-LM's default --memory-snapshot-path."""
MAX_ENTRIES = 100_000
"""Allocator events kept before a snapshot (Megatron-LM's trace_alloc_max_entries)."""


def rank_path(path: str | None, rank: int) -> Path:
    """This rank's snapshot file: ``<stem>_rank<R><suffix>`` of --memory-snapshot-path (or its default)."""
    base = Path(path or DEFAULT_PATH)
    return base.with_name(f"{base.stem}_rank{rank}{base.suffix}")


def oom_path(path: str | None, rank: int) -> Path:
    """Where the snapshot taken at an out-of-memory error goes (Megatron-LM's ``oom_rank-<R>_<name>``)."""
    base = Path(path or DEFAULT_PATH)
    return base.with_name(f"oom_rank-{rank}_{base.name}")


class MemoryHistory:
    """One rank's recording: :meth:`start` before the model is built, :meth:`after_iteration` each step."""

    def __init__(self, enabled: bool, path: str | None, log_interval: int, rank: int) -> None:
        self.enabled, self.log_interval, self.rank = enabled, log_interval, rank
        self.path, self.oom = rank_path(path, rank), oom_path(path, rank)

    def start(self) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=MAX_ENTRIES)
        oom = self.oom

        def on_oom(device, alloc, device_alloc, device_free) -> None:
            _dump(oom)
            log.error("out of GPU memory: allocator snapshot written to %s", oom)

        torch._C._cuda_attach_out_of_memory_observer(on_oom)
        log.info("recording the CUDA allocator's history; snapshots to %s", self.path)

    def after_iteration(self, iteration: int) -> None:
        """After iteration 1 and every --log-interval iterations (Megatron-LM's points): the snapshot so far,
        each replacing the last (the history in it reaches back MAX_ENTRIES events)."""
        if self.enabled and (iteration == 1 or iteration % self.log_interval == 0):
            _dump(self.path)

    def stop(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(enabled=None)


def _dump(path: Path) -> None:
    # Written beside, then renamed: a reader (or a job killed mid-write) never sees half a pickle.
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
    partial.replace(path)
