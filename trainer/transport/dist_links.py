"""Channels over torch.distributed point-to-point: gloo (CPU tensors) or NCCL (CUDA tensors).

Each directed edge gets its own two-rank process group, so the sends of one edge are never queued
behind another edge's (NCCL/gloo match P2P operations in order per communicator, which is what
deadlocks a greedy schedule on a shared communicator). A message is a fixed 16-word header
(:mod:`trainer.transport.wire`) followed by the payload bytes; the receiver thread always has the
next header receive posted, so arrivals never wait for the consumer to ask.

Flow control: at most ``max_in_flight`` uncompleted sends per channel on the sender, and at most
``max_in_flight`` arrived-but-undelivered messages per channel on the receiver (its receiver thread
stops receiving until ``poll`` hands one out), so neither side's memory grows without bound.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

from trainer.transport.base import Direction, Header, Message, TransportError, TransportTimeout
from trainer.transport.channels import Delivery, Inbox, ThreadedReceiver
from trainer.transport.tensors import BufferPool, as_bytes, check_matches, empty_bytes, from_bytes
from trainer.transport.wire import HEADER_WORDS, decode, encode, payload_nbytes

logger = logging.getLogger(__name__)

# A pre-posted header receive may legitimately wait for as long as the peer has nothing to send
# (evaluation, checkpointing). The process-group timeout would abort it (gloo raises, NCCL's
# watchdog kills the job), so edge groups get a long one; our own waits enforce ``timeout_s``.
EDGE_GROUP_TIMEOUT = datetime.timedelta(days=7)


def new_edge_group(src: int, dst: int, backend: str) -> dist.ProcessGroup:
    """Collective: every rank of the job must call this in the same order for every edge."""
    return dist.new_group([src, dst], timeout=EDGE_GROUP_TIMEOUT, backend=backend)


class ProcessGroupSender:
    """Outgoing half of one edge over its dedicated process group."""

    def __init__(
        self, rank: int, peer: int, direction: Direction, group: dist.ProcessGroup,
        device: torch.device, max_in_flight: int,
    ) -> None:  # fmt: skip
        self.rank, self.peer, self.direction = rank, peer, direction
        self._group, self._device, self._max_in_flight = group, device, max_in_flight
        self._pending: collections.deque[tuple[list[dist.Work], list[torch.Tensor]]] = collections.deque()
        self._sequence = 0
        self._closed = False
        self._lock = threading.Lock()

    def send(self, tensor: torch.Tensor, header: Header, timeout_s: float) -> None:
        check_matches(tensor, header)
        if tensor.device.type != self._device.type:
            raise ValueError(
                f"rank {self.rank}: {self.direction} channel to rank {self.peer} carries "
                f"{self._device.type} tensors, got one on {tensor.device}"
            )
        payload = as_bytes(tensor.detach())
        with self._lock:  # one message's header and payload must not interleave with another's
            if self._closed:
                raise TransportError(f"rank {self.rank}: {self.direction} channel to rank {self.peer} is closed")
            self._post(encode(header, self._sequence), payload)
            self._sequence += 1
            self._bound_in_flight(self._max_in_flight, timeout_s)

    def _post(self, words: list[int], payload: torch.Tensor | None) -> None:
        wire = torch.tensor(words, dtype=torch.int64)
        if self._device.type == "cuda":
            # Pinned + non_blocking: a pageable copy would synchronise the producer's stream (a
            # host stall on every send); the caching host allocator keeps the buffer until it ran.
            wire = wire.pin_memory().to(self._device, non_blocking=True)
        keep = [wire]
        try:
            works = [dist.isend(wire, dst=self.peer, group=self._group)]
            if payload is not None and payload.numel():
                works.append(dist.isend(payload, dst=self.peer, group=self._group))
                keep.append(payload)  # isend reads it asynchronously: keep it alive until completed
        except RuntimeError as exc:  # gloo refuses to post on a connection the peer closed
            raise self._error(exc, 0.0) from exc
        self._pending.append((works, keep))

    def _bound_in_flight(self, limit: int, timeout_s: float) -> None:
        while self._pending and all(w.is_completed() for w in self._pending[0][0]):
            self._pending.popleft()
        deadline = time.monotonic() + timeout_s
        while len(self._pending) > limit:
            works, _ = self._pending[0]
            for work in works:
                remaining = max(deadline - time.monotonic(), 0.001)
                try:
                    work.wait(datetime.timedelta(seconds=remaining))
                except Exception as exc:  # gloo raises RuntimeError for both timeouts and dead peers
                    raise self._error(exc, timeout_s) from exc
            self._pending.popleft()

    def _error(self, exc: Exception, timeout_s: float) -> TransportError:
        text = str(exc)
        if "imeout" in text or "imed out" in text:
            return TransportTimeout(
                f"rank {self.rank}: send to rank {self.peer} ({self.direction}) did not complete "
                f"within {timeout_s:.1f}s: peer not receiving ({text.splitlines()[0]})"
            )
        return TransportError(
            f"rank {self.rank}: send to rank {self.peer} ({self.direction}) failed, peer rank "
            f"{self.peer} is probably dead: {text.splitlines()[0] if text else exc!r}"
        )

    def close(self, timeout_s: float) -> None:
        with self._lock:  # after any send in progress on another thread
            if self._closed:
                return
            self._closed = True
            self._post(encode(None, self._sequence), None)
            self._bound_in_flight(0, timeout_s)


class ProcessGroupReceiver(ThreadedReceiver):
    """Incoming half of one edge: the thread receives a header, then its payload, and repeats."""

    def __init__(
        self, rank: int, peer: int, direction: Direction, group: dist.ProcessGroup,
        device: torch.device, credits: int, inbox: Inbox,
    ) -> None:  # fmt: skip
        super().__init__(rank, peer, direction, inbox, credits)
        self._group, self._device = group, device
        self._expected = 0
        self._pool = BufferPool(device, credits)
        self.start()

    def _on_thread_start(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
            # A stream of our own: NCCL receives make the current stream wait for the peer, and on
            # the default stream that would stall the consumer's compute until the peer sends.
            torch.cuda.set_stream(torch.cuda.Stream(self._device))

    def _receive_one(self) -> Message | None:
        words = self._recv(torch.empty(HEADER_WORDS, dtype=torch.int64, device=self._device))
        frame = decode(words.tolist())
        if frame.sequence != self._expected:
            raise TransportError(
                f"rank {self.rank}: message {frame.sequence} from rank {self.peer} arrived when "
                f"{self._expected} was due"
            )
        self._expected += 1
        if frame.header is None:
            return None
        assert frame.nbytes == payload_nbytes(frame.header), frame
        raw = self._recv(self._pool.take(frame.nbytes)) if frame.nbytes else empty_bytes(0, self._device)
        arrived = None
        if self._device.type == "cuda":
            arrived = torch.cuda.Event()
            arrived.record()  # on this thread's stream, after the payload receive
        return Message(frame.header, from_bytes(raw, frame.header), self.peer, Delivery(self, (arrived, raw)))

    def _recv(self, buffer: torch.Tensor) -> torch.Tensor:
        work = dist.irecv(buffer, src=self.peer, group=self._group)
        if self._device.type == "cuda":
            # A CUDA stream synchronize may spin a core for as long as the peer is idle; poll the
            # NCCL work's event instead, sleeping up to 1 ms between looks.
            pause = 20e-6
            while not work.is_completed():
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        work.wait()
        return buffer

    def on_delivered(self, message: Message) -> None:
        arrived = message.token.handle[0]
        if arrived is not None:  # CUDA: the consumer's stream waits for the receive, host does not
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_event(arrived)
            message.tensor.record_stream(consumer)
        super().on_delivered(message)

    def _failure(self, exc: Exception) -> TransportError:
        detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
        return TransportError(
            f"rank {self.rank}: receiving from rank {self.peer} ({self.direction} channel) failed, "
            f"peer rank {self.peer} is probably dead: {detail}"
        )

    def release(self, message: Message) -> None:
        """The tensor is the consumer's own copy; once released its buffer is reused."""
        try:
            self._pool.give_back(message.token.handle[1])
        except ValueError as exc:
            raise ValueError(f"rank {self.rank}: from rank {self.peer}: {exc}") from None
