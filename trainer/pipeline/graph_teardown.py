"""Tear-down with ``--dpp-cuda-graphs``: every captured graph is destroyed before any process group.

Why the order matters: a CUDA graph that captured an NCCL collective (the TP all-reduces, all-gathers
and reduce-scatters inside a slot's graphs at TP > 1) holds a reference on its communicator -- NCCL
attaches a CUDA user object to the graph at capture -- and ``ncclCommDestroy`` polls until every graph
holding one is destroyed (NCCL >= 2.26, "keep polling until all graphs referencing us die"). torch's
``destroy_process_group`` finalises and then destroys each communicator with no deadline, so a single
live graph keeps the rank there for ever (pytorch/pytorch#115388; NVIDIA's CUDA graph guide, "Process
hangs during teardown": destroy or ``reset()`` the graphs first). ``ncclCommAbort`` takes the same path
(``commReclaim`` -> ``commDestroySync``), so aborting instead of destroying does not help either.

The order, each step for a reason:

1. wait for the GPU (bounded by ``--dpp-timeout``): a graph is only released once its replays have
   run, and a rank whose queue holds a collective that a TP peer never queued (an unmatched collective
   in the last step) would wait here, not in the destroy -- the error then says so, naming the rank;
2. ``reset()`` every chunk's graphs (:meth:`ChunkGraphs.release`): destroys the executables whoever
   still holds the Python objects (an autograd node of the last step, a cycle awaiting the collector);
3. ``reset()`` any graph the module captured that no chunk holds (:func:`free_captured_graphs`);
4. collect garbage: what held the now-empty graphs and their pools' tensors goes;
5. empty the caching allocator: the graph pools' memory goes back before NCCL frees its own buffers.

The device operations come from a :class:`CudaTeardown` (a recorder in the CPU tests, which hold the
order to this list).
"""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class TeardownTimeout(RuntimeError):
    """The GPU did not drain before the graphs could be freed."""


class TeardownOps(Protocol):
    """What the tear-down does to the device (:class:`CudaTeardown`; a recorder in the CPU tests)."""

    def synchronize(self) -> None: ...

    def free_stray_graphs(self) -> int: ...

    def collect_garbage(self) -> None: ...

    def empty_cache(self) -> None: ...


class CudaTeardown:
    """The real device operations for one rank's GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def free_stray_graphs(self) -> int:
        from trainer.pipeline.cuda_graphs import free_captured_graphs

        return free_captured_graphs()

    def collect_garbage(self) -> None:
        gc.collect()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class FreedGraphs:
    """What :func:`free_graphs_before_groups` freed: per chunk, and graphs no chunk held."""

    per_chunk: dict[int, int]
    stray: int

    @property
    def total(self) -> int:
        return sum(self.per_chunk.values()) + self.stray


def _bounded(work, timeout_s: float) -> bool:
    """Run ``work`` in a daemon thread; whether it finished within ``timeout_s`` (its error re-raised)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="graph-teardown-sync", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    return not thread.is_alive()


def free_megatron_graphs(model: list) -> int:
    """``--cuda-graph-impl local``: destroy megatron-core's per-layer graphs (each layer runner's forward
    and backward graph) before the process groups, for the same reason as the runtime's (at TP > 1 they
    capture the layers' TP collectives); then megatron-core's own ``delete_cuda_graphs`` drops its
    records and pools. How many graphs were reset."""
    freed = 0
    for chunk in model:
        for module in chunk.modules():
            for runner in getattr(getattr(module, "cudagraph_manager", None), "cudagraph_runners", []):
                for name in ("fwd_graph", "bwd_graph"):
                    graph = getattr(runner, name, None)
                    if graph is not None and hasattr(graph, "reset"):
                        graph.reset()
                        freed += 1
    try:
        from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

        delete_cuda_graphs()
    except Exception:  # its records are gone with the process; the graphs themselves were reset above
        log.debug("megatron-core's delete_cuda_graphs failed", exc_info=True)
    return freed


def free_graphs_before_groups(graphs: dict, rank: int, ops: TeardownOps, timeout_s: float) -> FreedGraphs:
    """Free every CUDA graph of this rank (``graphs``: chunk index -> ChunkGraphs) in the order of the
    module docstring; call before the process groups are destroyed. Raises :class:`TeardownTimeout`
    naming the rank when the GPU does not drain within ``timeout_s``."""
    if not _bounded(ops.synchronize, timeout_s):
        raise TeardownTimeout(
            f"rank {rank}: the GPU did not finish the work queued before tear-down within {timeout_s:g} s "
            "(--dpp-timeout), so its CUDA graphs could not be freed. A collective this rank queued that a "
            "peer of its tensor-parallel group never queued (an unmatched collective in the last step) "
            "would hold it there; the peers' logs show whether they got this far")
    per_chunk = {c: chunk_graphs.release() for c, chunk_graphs in sorted(graphs.items())}
    stray = ops.free_stray_graphs()
    if stray:
        log.warning("rank %d: %d CUDA graph(s) captured but held by no chunk were freed at tear-down", rank, stray)
    ops.collect_garbage()
    ops.empty_cache()
    return FreedGraphs(per_chunk, stray)
