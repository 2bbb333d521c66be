"""Per-edge channels of the gloo and NCCL paths, all created at start-up in one global order.

Every directed edge ``src -> dst`` that does not use shared memory gets:

- a **header line** (:mod:`trainer.transport.header_lines`): one TCP connection that carries the
  edge's 128-byte headers (a gloo group would cost ~4x the latency: header_lines.py says why);
- a two-rank payload group: **gloo** for CPU payloads, **NCCL** for CUDA payloads.

Why headers travel on the host: an NCCL receive is a GPU kernel that spins until its sender sends.
Posting it ahead of time (before the peer has anything to send) can leave it spinning for as long
as the peer is busy, and any device-wide synchronisation on the receiver (a cudaFree, a communicator
set-up) then waits on that kernel forever. With the header on a host channel, the receiver posts the
NCCL receive only for a payload whose sender has already posted the matching send.

Why eagerly and in one order: torch creates an NCCL communicator lazily on a group's first operation.
Created from receiver threads in whatever order messages happened to arrive, two ranks could each
block inside a different communicator's set-up, waiting for the other (a hang seen on 4 GPUs).
Here every rank calls ``new_group`` for every edge in the plan's order (passing ``device_id`` where
torch accepts it, which makes torch connect the communicator inside ``new_group``), then the two
members of each NCCL edge exchange one byte, again in the plan's order, on the same thread. A
sequence of blocking two-party rendezvous taken in one global order cannot deadlock: the first
unfinished edge always has both its members waiting on it.
"""

from __future__ import annotations

import datetime
import inspect
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.transport.base import Direction, TransportError, TransportTimeout
from trainer.transport.header_lines import HeaderLine, connect_header_lines

PAYLOAD_TAG = 2

# A gloo payload receive may wait as long as the peer is slow to send it, and an NCCL send as long
# as its receiver is busy elsewhere (a checkpoint); the group timeout would abort them (gloo raises,
# NCCL's watchdog kills the job), so edge groups get a long one. Every wait of ours is bounded by
# the links' ``timeout_s`` instead, and names the peer.
EDGE_GROUP_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class EdgeGroup:
    """The process groups of one directed edge, as seen by one of its two members."""

    src: int
    dst: int
    direction: Direction
    header: HeaderLine
    """This rank's end of the edge's header connection."""
    payload: dist.ProcessGroup
    """gloo for CPU payloads, NCCL for CUDA payloads."""
    backend: str
    """"gloo" or "nccl": how payloads travel."""


def _new_group(ranks: list[int], backend: str, device: torch.device | None) -> dist.ProcessGroup:
    kwargs: dict = {"timeout": EDGE_GROUP_TIMEOUT, "backend": backend}
    if device is not None and "device_id" in inspect.signature(dist.new_group).parameters:
        kwargs["device_id"] = device  # torch >= 2.6: connect the communicator now, not at first use
    return dist.new_group(ranks, **kwargs)


def build_edge_groups(
    edges: list[tuple[int, int, Direction, str]], rank: int, device: torch.device, timeout_s: float
) -> dict[tuple[int, int, Direction], EdgeGroup]:
    """COLLECTIVE over every rank of the job, with the same ``edges`` list (``(src, dst, direction,
    backend)`` in plan order) on each. Returns the groups of the edges this rank belongs to."""
    groups: dict[tuple[int, int, Direction], EdgeGroup] = {}
    if not edges:  # pp = 1, or every edge on shared memory: no collective at all
        return groups
    lines = connect_header_lines([(s, d, w) for s, d, w, _ in edges], rank, dist.get_world_size(), timeout_s)
    for src, dst, direction, backend in edges:
        if backend == "nccl":
            payload = _new_group([src, dst], "nccl", device if rank in (src, dst) else None)
        else:
            payload = _new_group([src, dst], "gloo", None)
        if rank in (src, dst):
            groups[(src, dst, direction)] = EdgeGroup(src, dst, direction, lines[(src, dst, direction)], payload, backend)
    for src, dst, direction, backend in edges:  # plan order on every rank: see module docstring
        if backend == "nccl" and rank in (src, dst):
            _warm_up(groups[(src, dst, direction)], rank, device, timeout_s)
    return groups


def _warm_up(edge: EdgeGroup, rank: int, device: torch.device, timeout_s: float) -> None:
    """One byte src -> dst on the NCCL group: creates (or checks) the communicator that every later
    send/recv of this edge uses, on this thread, now."""
    peer = edge.dst if rank == edge.src else edge.src
    byte = torch.ones(1, dtype=torch.uint8, device=device)
    what = f"NCCL set-up of edge {edge.src}->{edge.dst} ({edge.direction})"
    try:
        if rank == edge.src:
            work = dist.isend(byte, dst=peer, group=edge.payload)
        else:
            work = dist.irecv(byte, src=peer, group=edge.payload)
        wait_work(work, time.monotonic() + timeout_s, lambda: None)
    except TransportTimeout:
        raise TransportTimeout(
            f"rank {rank}: {what} did not complete within {timeout_s:.1f}s: rank {peer} never joined"
        ) from None
    except Exception as exc:
        raise TransportError(f"rank {rank}: {what} with rank {peer} failed: {exc}") from exc


def wait_work(work: dist.Work, deadline: float, pump) -> None:  # noqa: ANN001 - a callable
    """Poll an NCCL ``work`` until it completed, calling ``pump()`` between looks and sleeping
    20 us .. 1 ms (no core spins, no stream synchronize); TransportTimeout past ``deadline``."""
    pause = 20e-6
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TransportTimeout("work not completed")
        pump()
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    work.wait()  # raises the work's error, if any; on CUDA only orders the current stream
