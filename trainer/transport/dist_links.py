"""Channels over torch.distributed point-to-point: gloo (CPU payloads) or NCCL (CUDA payloads).

Each directed edge has its own channels (:mod:`trainer.transport.edge_groups`): a TCP *header
line* for the 16-word header (:mod:`trainer.transport.wire`, :mod:`trainer.transport.header_lines`)
and a two-rank payload group (gloo for CPU payloads, NCCL for CUDA payloads).

Protocol of one message: the sender writes the header on the header line, then posts the payload
send. On the receiver the headers are read in order -- by the consumer itself when the rank
receives only on header lines (:class:`PolledGroupReceiver`, sleeping on
:class:`~trainer.transport.dist_progress.HeaderBell`), else
by a *header thread* per line that hands each arrival to the rank's inbox -- and each becomes an
*announced* message; header reads never touch NCCL. The payload receive is posted
by the rank's own consumer thread -- when it takes the message out (``on_delivered``), or earlier
while it waits for anything else (``DistProgress.pump``, trainer/transport/dist_progress.py) -- so:

- no NCCL receive is posted before its sender has posted the matching send (no receive kernel
  spinning on the GPU for a message that may never come);
- every NCCL call of a rank comes from its consumer thread, under one lock (``DistProgress.lock``);
- a CUDA message is handed out as soon as its receive is posted: the consumer's stream waits for
  the payload, the host does not.

Flow control (the ``credits`` K of LinkOptions): a sender has at most K uncompleted sends per
channel, and a receiver posts at most K payload receives ahead of delivery per channel. A send
completes when the peer posted its receive, so a sender waits only while its peer holds K
announced-but-undelivered messages, as with the shared-memory ring's K slots. Any rank waiting
inside this module (a send on exhausted credits, a CPU payload, ``close``) keeps posting receives
for what its peers announced, so two ranks sending to each other never wait on each other.

Every wait is bounded by the links' timeout and its TransportTimeout names the rank, the peer and
what was awaited; a dead peer is reported as a TransportError naming it.
"""

from __future__ import annotations

import collections
import logging
import select
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.transport.base import Header, Message, TransportError, TransportTimeout
from trainer.transport.channels import ChannelFailure, Delivery, Inbox
from trainer.transport.dist_progress import (
    MAX_PAUSE_S,
    DistProgress,
    FailedDone,
    GlooWatcher,
    NcclDone,
    await_done,
    describe_error,
)
from trainer.transport.edge_groups import PAYLOAD_TAG, EdgeGroup
from trainer.transport.tensors import BufferPool, as_bytes, check_matches, empty_bytes, from_bytes
from trainer.transport.wire import HEADER_BYTES, Frame, decode, encode, pack, unpack

log = logging.getLogger(__name__)


# ---- sending ----------------------------------------------------------------------------------------
@dataclass
class _InFlight:
    sequence: int
    what: str
    dones: list
    keep: list
    """Tensors the operations read asynchronously: alive until completed."""


class ProcessGroupSender:
    """Outgoing half of one edge: header on the edge's header line, payload on its payload group."""

    def __init__(
        self, rank: int, edge: EdgeGroup, device: torch.device, max_in_flight: int, progress: DistProgress
    ) -> None:  # fmt: skip
        self.rank, self.peer, self.direction = rank, edge.dst, edge.direction
        self._edge, self._device, self._max_in_flight = edge, device, max_in_flight
        self._progress = progress
        self._watcher = (GlooWatcher(f"mdpp-sendwatch-{rank}-{edge.dst}-{edge.direction}")
                         if edge.backend == "gloo" else None)  # NCCL works are polled, gloo ones watched
        self._pending: collections.deque[_InFlight] = collections.deque()
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
            what = f"{header.kind} microbatch {header.microbatch} chunk {header.chunk}"
            self._post(encode(header, self._sequence), payload, what, timeout_s)
            self._sequence += 1
            self._bound_in_flight(self._max_in_flight, timeout_s)

    def _post(self, words: list[int], payload: torch.Tensor | None, what: str, timeout_s: float) -> None:
        # The header first: the peer's header thread and consumer wake while the payload send is posted.
        self._edge.header.send(pack(words), timeout_s)  # TransportError/Timeout naming the peer
        dones: list = []
        keep: list = []
        if payload is not None and payload.numel():
            try:
                with self._progress.lock:
                    self._progress.pump()  # first let the peers' waiting sends complete
                    work = dist.isend(payload, dst=self.peer, group=self._edge.payload, tag=PAYLOAD_TAG)
            except RuntimeError as exc:  # gloo refuses to post on a connection the peer closed
                raise self._dead(exc) from exc
            dones.append(NcclDone(work) if self._watcher is None else self._watcher.watch(work))
            keep.append(payload)
        self._pending.append(_InFlight(self._sequence, what, dones, keep))

    def _bound_in_flight(self, limit: int, timeout_s: float) -> None:
        try:
            while self._pending and all(d.done() for d in self._pending[0].dones):
                self._pending.popleft()
            deadline = time.monotonic() + timeout_s
            while len(self._pending) > limit:
                oldest = self._pending[0]
                if not await_done(oldest.dones, deadline, self._progress.pump):
                    raise TransportTimeout(
                        f"rank {self.rank}: send of message {oldest.sequence} ({oldest.what}) to rank "
                        f"{self.peer} ({self.direction} channel) did not complete within {timeout_s:.1f}s: "
                        f"rank {self.peer} is not receiving"
                    )
                self._pending.popleft()
        except TransportError:
            raise
        except Exception as exc:
            raise self._dead(exc) from exc

    def _dead(self, exc: Exception) -> TransportError:
        return TransportError(
            f"rank {self.rank}: send to rank {self.peer} ({self.direction} channel) failed, peer rank "
            f"{self.peer} is probably dead: {describe_error(exc)}"
        )

    def close(self, timeout_s: float) -> None:
        with self._lock:  # after any send in progress on another thread
            if self._closed:
                return
            self._closed = True
            try:
                self._post(encode(None, self._sequence), None, "end of stream", timeout_s)
                self._bound_in_flight(0, timeout_s)
            finally:
                if self._watcher is not None:
                    self._watcher.stop()
                self._edge.header.close()


# ---- receiving --------------------------------------------------------------------------------------
@dataclass
class _Arrival:
    """``Message.token.handle`` of this transport: where the message's payload stands."""

    frame: Frame
    state: str = "announced"
    """announced (header here) -> posted (payload receive posted) -> delivered -> released; or dropped."""
    buffer: torch.Tensor | None = None
    done: Any = None


class ProcessGroupReceiver:
    """Incoming half of one edge (see the module docstring for who posts what).

    Two ways to read the headers: a *header thread* that blocks on the line and puts each arrival
    into the rank's inbox (``polled=False``: ranks that also receive on shared-memory rings, whose
    consumer sleeps on the rings' doorbell), or the consumer itself (``polled=True``: ranks whose
    incoming channels are all header lines; :class:`PolledGroupReceiver`, whose ``try_receive``
    reads what the line holds while the consumer sleeps on :class:`HeaderBell`), which saves a
    thread hand-off per message.
    """

    def __init__(
        self, rank: int, edge: EdgeGroup, device: torch.device, credits: int, inbox: Inbox,
        progress: DistProgress, timeout_s: float, polled: bool = False,
    ) -> None:  # fmt: skip
        self.rank, self.peer, self.direction = rank, edge.src, edge.direction
        self._edge, self._device, self._credits, self._inbox = edge, device, credits, inbox
        self._progress, self._timeout_s = progress, timeout_s
        self._lock = threading.Lock()  # the deques and state below (the header thread appends)
        self._announced: collections.deque[Message] = collections.deque()
        self._posted: collections.deque[Message] = collections.deque()
        self._closing = False
        self._ended = threading.Event()  # end of stream seen, or the header thread failed
        self._expected = 0
        self._failure: TransportError | None = None  # what stopped the header reads, if they failed
        self._pool = BufferPool(device, credits)
        self._watcher = GlooWatcher(f"mdpp-recvwatch-{edge.src}-{rank}-{edge.direction}") if edge.backend == "gloo" else None
        self.polled = polled
        self._ready: collections.deque[Message] = collections.deque()  # polled: read, not handed out yet
        self._partial = bytearray()  # polled: the start of a header whose rest has not arrived
        # polled: one reader of the line at a time. The consumer reads it (try_receive) and so does
        # whichever thread pumps the rank's progress (post_announced, e.g. a sender waiting for
        # credit): two unserialised reads can append their chunks to _partial out of order.
        self._read_lock = threading.Lock()
        self._thread = None if polled else threading.Thread(
            target=self._header_loop, name=f"mdpp-headers-{edge.src}-{rank}-{edge.direction}", daemon=True
        )
        progress.add(self)
        if self._thread is not None:
            self._thread.start()

    def _on_header(self, raw: bytes) -> Message | None:
        """One header read off the line: the message to hand out, or None (end of stream, or closing)."""
        frame = decode(unpack(raw))
        if frame.sequence != self._expected:
            raise TransportError(
                f"rank {self.rank}: message {frame.sequence} from rank {self.peer} arrived when "
                f"{self._expected} was due ({self.direction} channel)"
            )
        self._expected += 1
        if frame.end_of_stream:
            self._ended.set()
            return None
        message = Message(frame.header, None, self.peer, Delivery(self, _Arrival(frame)))
        with self._lock:
            self._announced.append(message)
            visible = not self._closing
        return message if visible else None

    # ---- polled: the consumer reads the line --------------------------------------------------------
    @property
    def line(self):  # noqa: ANN201 - a HeaderLine
        return self._edge.header

    @property
    def reading(self) -> bool:
        """Whether headers may still come (false after the end of stream or a failure)."""
        return not self._ended.is_set()

    def _read_headers(self) -> None:
        """Decode every whole header the line holds; never waits on the line (only, briefly, on another
        thread reading it). A failure is kept in ``_failure``
        (raised by :meth:`try_receive` / :meth:`check_peer`, after the messages read before it)."""
        if not self.polled or self._ended.is_set():
            return
        with self._read_lock:
            self._read_headers_locked()

    def _read_headers_locked(self) -> None:
        if self._ended.is_set():
            return
        try:
            data = self._edge.header.read_available()
            if not data:
                return
            self._partial += data
            while len(self._partial) >= HEADER_BYTES and not self._ended.is_set():
                raw = bytes(self._partial[:HEADER_BYTES])
                del self._partial[:HEADER_BYTES]
                message = self._on_header(raw)
                if message is not None:
                    self._ready.append(message)
        except TransportError as exc:
            self._failure = exc
            self._ended.set()
        except Exception as exc:  # a corrupt header: one clear error naming the channel
            self._failure = TransportError(
                f"rank {self.rank}: receiving from rank {self.peer} ({self.direction} channel) failed: {describe_error(exc)}")
            self._ended.set()

    # ---- header thread (socket reads only) ------------------------------------------------------------
    def _header_loop(self) -> None:
        try:
            while not self._ended.is_set():
                message = self._on_header(self._edge.header.receive(HEADER_BYTES))
                if message is not None:
                    self._inbox.put(message)
        except TransportError as exc:
            self._report(exc)
        except Exception as exc:  # report, never die silently: the consumer's next poll raises it
            self._report(TransportError(
                f"rank {self.rank}: receiving from rank {self.peer} ({self.direction} channel) failed, "
                f"peer rank {self.peer} is probably dead: {describe_error(exc)}"))
        finally:
            self._ended.set()

    def _report(self, error: TransportError) -> None:
        self._failure = error  # a payload wait in progress stops at once (see _complete)
        with self._lock:
            closing = self._closing
        if not closing:
            self._inbox.put(ChannelFailure(error))

    # ---- consumer side ------------------------------------------------------------------------------
    def post_announced(self) -> None:
        """Post payload receives for announced messages, oldest first, while fewer than ``credits``
        wait for delivery (all of them once closing). Caller holds ``DistProgress.lock``."""
        self._read_headers()  # polled: what a peer blocked in its send announced
        while True:
            with self._lock:
                if not self._announced or (not self._closing and len(self._posted) >= self._credits):
                    return
                message = self._announced.popleft()
                self._posted.append(message)
            arrival = message.token.handle
            nbytes = arrival.frame.nbytes
            arrival.buffer = self._pool.take(nbytes) if nbytes else empty_bytes(0, self._device)
            arrival.state = "posted"
            if nbytes:
                try:
                    work = dist.irecv(arrival.buffer, src=self.peer, group=self._edge.payload, tag=PAYLOAD_TAG)
                except RuntimeError as exc:
                    arrival.done = FailedDone(exc)
                    continue
                arrival.done = NcclDone(work) if self._watcher is None else self._watcher.watch(work)

    def on_delivered(self, message: Message) -> None:
        """In the consumer's thread, as ``poll``/``wait_any`` hands ``message`` out."""
        arrival = message.token.handle
        self._progress.pump()  # posts this message's receive if not yet: it is the channel's oldest
        with self._lock:
            if not self._posted or self._posted[0] is not message:
                raise TransportError(
                    f"rank {self.rank}: message {arrival.frame.sequence} from rank {self.peer} "
                    f"({self.direction} channel) delivered out of order"
                )
            self._posted.popleft()
        if isinstance(arrival.done, NcclDone):  # the stream that first reads it waits (see Message)
            message.wait_when_used(arrival.done.work.wait)
        else:
            self._complete(arrival, self._timeout_s)
        arrival.state = "delivered"
        message.tensor = from_bytes(arrival.buffer, message.header)

    def landed(self, message: Message) -> bool:
        """An NCCL payload is on this GPU once its receive's work completed (an event query)."""
        done = getattr(message.token.handle, "done", None)
        return not isinstance(done, NcclDone) or done.work.is_completed()

    def _complete(self, arrival: _Arrival, timeout_s: float) -> None:
        """CPU: wait until the payload is in (bounded). CUDA: the current stream waits for it."""
        if arrival.done is None:  # empty payload
            return
        what = (f"the payload of message {arrival.frame.sequence} ({arrival.frame.nbytes} bytes) from rank "
                f"{self.peer} ({self.direction} channel)")  # fmt: skip
        try:
            if isinstance(arrival.done, NcclDone):
                arrival.done.work.wait()  # stream-ordered: the host does not wait
                return
            if not await_done([arrival.done], time.monotonic() + timeout_s, self._pump_or_fail):
                raise TransportTimeout(
                    f"rank {self.rank}: {what} did not arrive within {timeout_s:.1f}s of its header"
                )
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(
                f"rank {self.rank}: receiving {what} failed, peer rank {self.peer} is probably dead: "
                f"{describe_error(exc)}"
            ) from exc

    def _pump_or_fail(self) -> None:
        """Between looks at a payload: progress, and the header thread's news -- its receive fails
        as soon as the peer's process is gone, while a gloo payload receive may wait for its timeout."""
        self._progress.pump()
        if self._failure is not None:
            raise self._failure

    def release(self, message: Message) -> None:
        """A delivered message's buffer is reused once released; an undelivered one (drained at
        close) still has its payload received, so the sender's send completes."""
        arrival = message.token.handle
        if arrival.state == "released":
            raise ValueError(f"rank {self.rank}: from rank {self.peer}: a received message was released twice")
        if arrival.state == "delivered":
            arrival.state = "released"
            self._pool.give_back(arrival.buffer)
            return
        if arrival.state != "dropped":
            self._drop_undelivered(self._timeout_s)

    # ---- shutdown -----------------------------------------------------------------------------------
    def begin_close(self) -> None:
        """From now on arrivals are not delivered; their payloads are still received (and dropped)."""
        with self._lock:
            self._closing = True
            self._ready.clear()  # polled: still announced or posted, so close drops them

    def _drop_undelivered(self, timeout_s: float) -> None:
        """Post every announced payload receive, finish the posted ones and drop them."""
        with self._lock:
            self._closing = True
        self._progress.pump()
        with self._lock:
            posted, self._posted = list(self._posted), collections.deque()
        for message in posted:
            arrival = message.token.handle
            try:
                self._complete(arrival, timeout_s)
            except TransportError as exc:
                log.debug("rank %d: dropping an undelivered message: %s", self.rank, exc)
            arrival.state = "dropped"

    def close(self, timeout_s: float) -> None:
        """Receive (and drop) everything up to the peer's end of stream, for up to ``timeout_s``."""
        self.begin_close()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                self._drop_undelivered(max(deadline - time.monotonic(), 0.001))
                with self._lock:
                    drained = not self._announced and not self._posted
                if self._ended.is_set() and drained:
                    return
                if time.monotonic() >= deadline:
                    raise TransportTimeout(
                        f"rank {self.rank}: rank {self.peer} did not close its {self.direction} channel "
                        f"within {timeout_s:.1f}s"
                    )
                if self.polled:
                    select.select([self._edge.header], [], [], MAX_PAUSE_S)  # until more arrives
                else:
                    self._ended.wait(MAX_PAUSE_S)
        finally:
            self._progress.remove(self)
            if self._watcher is not None:
                self._watcher.stop()
            self._edge.header.close()


class PolledGroupReceiver(ProcessGroupReceiver):
    """A :class:`ProcessGroupReceiver` whose consumer reads the header line itself (a
    ``channels.PolledReceiver``; only these two methods make it one)."""

    def __init__(
        self, rank: int, edge: EdgeGroup, device: torch.device, credits: int, inbox: Inbox,
        progress: DistProgress, timeout_s: float,
    ) -> None:  # fmt: skip
        super().__init__(rank, edge, device, credits, inbox, progress, timeout_s, polled=True)

    def try_receive(self) -> Message | None:
        """The next message whose header is in, else None (PolledReceiver)."""
        self._read_headers()
        if self._ready:
            return self._ready.popleft()
        if self._failure is not None and not self._closing:
            raise self._failure
        return None

    def check_peer(self) -> None:
        """A dead peer ends the line, which the next read reports."""
        self._read_headers()
        if self._failure is not None and not self._ready and not self._closing:
            raise self._failure
