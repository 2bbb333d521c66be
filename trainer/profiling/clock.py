"""Clock offset of this rank against rank 0, measured once at start-up by ping-pong round trips.

Each rank's trace timestamps come from its own wall clock; on several nodes those clocks differ by
anything from microseconds (PTP) to milliseconds (NTP) and more. One round trip gives rank r the
times t0 (r sends), t1 (rank 0 answers, rank 0's clock) and t2 (r receives the answer). If the two
legs take equally long, rank 0's clock read t1 when r's clock read (t0 + t2) / 2, so
``offset = t1 - (t0 + t2) / 2`` and the error is at most half the round trip time (RTT). We keep
the estimate of the round trip with the smallest RTT: scheduling noise only ever lengthens a trip,
so the shortest one is the least disturbed (Cristian's algorithm / NTP's minimum filter).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainer.profiling.tracer import now_us

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundTrip:
    """One ping-pong as rank r saw it (µs)."""

    sent_us: float
    """t0: r's clock when it sent the ping."""
    root_us: float
    """t1: rank 0's clock when it answered."""
    received_us: float
    """t2: r's clock when the answer arrived."""

    @property
    def rtt_us(self) -> float:
        return self.received_us - self.sent_us

    @property
    def offset_us(self) -> float:
        """µs to add to r's clock to read rank 0's, assuming symmetric legs."""
        return self.root_us - (self.sent_us + self.received_us) / 2.0


def best_offset(trips: Sequence[RoundTrip]) -> RoundTrip:
    """The round trip with the smallest RTT (its offset is the least disturbed estimate)."""
    if not trips:
        raise ValueError("best_offset needs at least one round trip, got none")
    return min(trips, key=lambda trip: trip.rtt_us)


def measure_clock_offset(group=None, rounds: int = 8, *, timeout_s: float = 120.0,
                         clock_us: Callable[[], float] = now_us) -> float:
    """µs to add to this rank's :func:`now_us` timestamps to read rank 0's clock (0.0 on rank 0).

    Collective over ``group`` (default: the world): every rank must call it. Rank 0 serves the
    other ranks one after another, ``rounds`` round trips each; a rank that waits for its turn
    sees one long first trip, which the minimum-RTT filter discards. ``clock_us`` exists so tests
    can inject a skewed clock. Raises TimeoutError naming the waiting rank and its peer.
    """
    import torch
    import torch.distributed as dist

    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if size == 1:
        return 0.0
    global_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    # NCCL only moves CUDA tensors; gloo (CPU tests, CPU-only jobs) only CPU ones.
    on_cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    buffer = torch.zeros(1, dtype=torch.float64, device=device)
    timeout = datetime.timedelta(seconds=timeout_s)
    me = dist.get_rank()

    def exchange(op, peer_group_rank: int, what: str) -> None:
        peer = global_rank(peer_group_rank)
        work = op(buffer, peer, group=group)
        try:
            work.wait(timeout)
        except RuntimeError as err:  # gloo and NCCL both report a timed-out wait as RuntimeError
            raise TimeoutError(
                f"rank {me}: clock sync waited more than {timeout_s:g} s for {what} rank {peer}: {err}"
            ) from err
        if on_cuda:
            # An NCCL wait only orders the current stream; the host reads its clock next, so it
            # must wait for the transfer itself, or t1/t2 would predate the message's arrival.
            torch.cuda.synchronize(device)

    if rank == 0:
        for peer in range(1, size):
            for _ in range(rounds):
                exchange(dist.irecv, peer, "the ping from")
                buffer.fill_(clock_us())
                exchange(dist.isend, peer, "the pong to be taken by")
        return 0.0

    trips = []
    for _ in range(rounds):
        sent = clock_us()
        buffer.fill_(sent)
        exchange(dist.isend, 0, "its ping to be taken by")
        exchange(dist.irecv, 0, "the pong from")
        received = clock_us()
        trips.append(RoundTrip(sent, float(buffer.item()), received))
    best = best_offset(trips)
    log.info("rank %d: clock offset to rank 0 %.1f us (best RTT %.1f us of %d round trips)",
                me, best.offset_us, best.rtt_us, rounds)
    return best.offset_us
