"""One rank's channels bundled into a :class:`StageLinks`: sends by direction, one shared inbox.

Two kinds of incoming channel:

- *polled* (:class:`PolledReceiver`, the shared-memory rings: CPU payloads, and the CUDA IPC
  control rings): the consumer's own thread reads the ring in ``poll``/``wait_any``. Every sender into this rank bumps one futex word, the rank's
  :class:`Doorbell`, on each commit, so ``wait_any`` sleeps on that single word for "something
  arrived anywhere" — one wake-up per message and no hand-off between threads.
- *threaded* (:class:`ThreadedReceiver`: gloo/NCCL): a receiver thread blocks (with the
  GIL released) and puts each arrival into the rank's :class:`Inbox`, which rings the doorbell too
  when there is one, so channels of different transports are still waited on together.

No core spins while idle: every wait is a futex or condition-variable sleep.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from trainer.problems import problems_text
from trainer.transport.base import Direction, Message, StageLinks, TransportError, TransportTimeout

log = logging.getLogger(__name__)

_CLOSE_AFTER_FAILURE_S = 1.0
# How long a Python waiter that finds nothing looks again before sleeping: the consumer on its inbox
# (_wait_on_inbox below) and dist_progress.HeaderBell on its header lines -- the one constant for both.
# On the Firecracker GPU hosts waking a thread whose vCPU halted costs ~75 us, and a header usually
# lands within tens of microseconds of the consumer running dry. The C++ side has its own copy of the
# same value (kSpinS in csrc/shm_ring.cpp, the shared-memory rings and their doorbell); it does not
# read this override. Each inbox look releases the GIL (sleep(0)) so the receiver thread can put.
# Measured in one 4xH100 call, spin 0 / 100 / 0 us: NCCL path 8 MiB one-way 391 / 308 / 397 us
# (docs/transport.md). MDPP_INBOX_SPIN_US overrides it (0 = sleep at once), for measuring.
SPIN_S = float(os.environ.get("MDPP_INBOX_SPIN_US", "100")) / 1e6


@dataclass(frozen=True)
class ChannelFailure:
    """Put in the inbox by a receiver thread that stopped on an error (peer died, corrupt data)."""

    error: TransportError


class Doorbell(Protocol):
    """A counter that every arrival for this rank bumps (``trainer.transport._shm_ring.Doorbell``)."""

    @property
    def seq(self) -> int: ...

    def ring(self) -> None: ...

    def wait(self, seen: int, timeout_s: float) -> bool:
        """Sleep until ``seq != seen`` or ``timeout_s`` passes (GIL released)."""


class Inbox:
    """Arrivals of the threaded incoming channels of one rank, oldest first (thread-safe)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Message | ChannelFailure] = queue.Queue()
        self.doorbell: Doorbell | None = None
        """Rung after every put when the rank also has polled channels (its consumer sleeps on it)."""

    def put(self, item: Message | ChannelFailure) -> None:
        self._queue.put(item)
        if self.doorbell is not None:
            self.doorbell.ring()

    def get(self, timeout: float | None) -> Message | ChannelFailure | None:
        """Next arrival; None if none came within ``timeout`` (0 = do not wait)."""
        try:
            if timeout == 0:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> list[Message | ChannelFailure]:
        items = []
        while (item := self.get(0)) is not None:
            items.append(item)
        return items


class SendChannel(Protocol):
    """Outgoing half of one directed edge."""

    peer: int

    def send(self, tensor: Any, header: Any, timeout_s: float) -> None: ...

    def close(self, timeout_s: float) -> None:
        """Flush pending sends, then tell the peer no more messages come (end of stream)."""


class RecvChannel(Protocol):
    """Incoming half of one directed edge: a receiver thread feeds the rank's inbox, or the consumer
    reads it directly (:class:`PolledReceiver`)."""

    peer: int

    def on_delivered(self, message: Message) -> None:
        """Called in the consumer's thread when ``poll`` hands ``message`` out."""

    def release(self, message: Message) -> None: ...

    def begin_close(self) -> None:
        """Stop delivering: later arrivals are dropped and their slots freed at once."""

    def close(self, timeout_s: float) -> None:
        """Wait for the peer's end of stream (or its death), then free resources."""


@runtime_checkable
class PolledReceiver(RecvChannel, Protocol):
    """An incoming channel that the consumer's thread reads itself (no receiver thread)."""

    def try_receive(self) -> Message | None:
        """The next message if one has arrived, else None; never blocks on an empty channel.
        Raises TransportError if the channel is broken."""

    def check_peer(self) -> None:
        """Raise TransportError if the sending process died (called every ``peer_check_s``)."""


class ThreadedReceiver:
    """Base of a channel's receiving half: a daemon thread moves arrivals into the inbox.

    At most ``credits`` arrived-but-undelivered messages wait in the inbox per channel (the thread
    stops receiving until ``poll`` hands one out), so an idle consumer bounds this side's memory and
    back-pressure reaches the sender. Errors never kill the thread silently: they become a
    :class:`ChannelFailure` that the consumer's next ``poll``/``wait_any`` raises.
    """

    _CREDIT_POLL_S = 0.2  # how often a thread blocked on credits re-checks for close()

    def __init__(self, rank: int, peer: int, direction: Direction, inbox: Inbox, credits: int) -> None:
        self.rank, self.peer, self.direction = rank, peer, direction
        self._inbox = inbox
        self._credits = threading.Semaphore(credits)
        self._closing = threading.Event()
        self._abandon = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"mdpp-recv-{peer}-{rank}-{direction}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        # A daemon thread still inside a C++ wait when the interpreter finalises aborts the process,
        # so stop it at exit if the owner never called close().
        atexit.register(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        self._abandon.set()
        self._interrupt()
        self._thread.join(2.0)

    # ---- for subclasses ----------------------------------------------------------------------------
    def _receive_one(self) -> Message | None:
        """Block until the next message arrives; None at the peer's end of stream."""
        raise NotImplementedError

    def _on_thread_start(self) -> None:
        """Per-thread set-up (e.g. the CUDA device)."""

    def _interrupt(self) -> None:
        """Wake the thread out of its wait, if the transport can (it then sees ``_abandon``)."""

    def _failure(self, exc: Exception) -> TransportError:
        detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
        return TransportError(
            f"rank {self.rank}: receiving from rank {self.peer} ({self.direction} channel) failed: {detail}"
        )

    # ---- thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._on_thread_start()
            while not self._abandon.is_set():
                # Past close() undelivered messages are dropped, so drain to end-of-stream freely.
                while not self._closing.is_set() and not self._credits.acquire(timeout=self._CREDIT_POLL_S):
                    pass
                message = self._receive_one()
                if message is None:
                    return
                if self._closing.is_set():  # nobody will consume it: free its slot at once
                    self.release(message)
                    continue
                self._inbox.put(message)
        except TransportError as exc:
            self._inbox.put(ChannelFailure(exc))
        except Exception as exc:  # report, never die silently: the consumer's next poll raises it
            self._inbox.put(ChannelFailure(self._failure(exc)))

    def on_delivered(self, message: Message) -> None:
        self._credits.release()  # the message is the consumer's now: receive the next one

    def release(self, message: Message) -> None:
        raise NotImplementedError

    def begin_close(self) -> None:
        """From now on arrivals are dropped (their slots freed), so a blocked sender can finish."""
        self._closing.set()

    def close(self, timeout_s: float) -> None:
        """Wait for the peer's end of stream (or its death) for up to ``timeout_s``."""
        self._closing.set()
        self._thread.join(timeout_s)
        atexit.unregister(self._stop_at_exit)
        if self._thread.is_alive():
            self._abandon.set()  # the peer never closed: stop waiting for it
            self._interrupt()
            raise TransportTimeout(
                f"rank {self.rank}: rank {self.peer} did not close its {self.direction} channel "
                f"within {timeout_s:.1f}s"
            )


@dataclass(frozen=True)
class Delivery:
    """``Message.token`` of every channel transport: which channel to release into, and its handle."""

    channel: RecvChannel
    handle: Any = None


class ChannelStageLinks(StageLinks):
    """StageLinks over per-edge channels of any transport (see module docstring)."""

    def __init__(
        self,
        rank: int,
        senders: dict[Direction, SendChannel],
        receivers: list[RecvChannel],
        inbox: Inbox,
        timeout_s: float,
        description: str = "",
        peer_check_s: float = 0.05,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.description = description
        """Human-readable channel map, logged at start-up (e.g. 'next->1:shm prev->3:gloo')."""
        self._senders = senders
        self._receivers = receivers
        self._inbox = inbox
        self._polled = [r for r in receivers if isinstance(r, PolledReceiver)]
        if self._polled and inbox.doorbell is None:
            raise ValueError(f"rank {rank}: polled receivers need the inbox's doorbell to wait on")
        self._turn = 0  # the polled channel looked at first next time (round robin: none starves)
        self._peer_check_s = peer_check_s
        self._next_peer_check = time.monotonic() + peer_check_s
        self._failure: TransportError | None = None
        self._closed = False

    # ---- sending ---------------------------------------------------------------------------------
    def send(self, direction: Direction, tensor: Any, header: Any) -> None:
        self._check_usable()
        channel = self._senders.get(direction)
        if channel is None:
            raise ValueError(
                f"rank {self.rank} has no {direction!r} channel (directions: {sorted(self._senders)})"
            )
        channel.send(tensor, header, self.timeout_s)

    # ---- receiving -------------------------------------------------------------------------------
    def poll(self) -> Message | None:
        self._check_usable()
        message = self._deliver(self._next_arrival())
        if message is None:
            self._check_polled_peers(time.monotonic())
        return message

    def wait_any(self, timeout: float) -> Message:
        self._check_usable()
        if not self._receivers:
            raise TransportError(f"rank {self.rank} has no incoming channels to wait on")
        deadline = time.monotonic() + timeout
        while True:
            message = self._wait_on_doorbell(deadline) if self._polled else self._wait_on_inbox(deadline)
            if message is not None:
                return message
            if time.monotonic() >= deadline:
                peers = sorted({r.peer for r in self._receivers})
                raise TransportTimeout(
                    f"rank {self.rank} waited {timeout:.1f}s for a message from ranks {peers}; none came"
                )

    def _wait_on_doorbell(self, deadline: float) -> Message | None:
        """Look at every channel; if nothing is there, sleep on the doorbell for one peer-check slice."""
        doorbell = self._inbox.doorbell
        seen = doorbell.seq  # read BEFORE looking: an arrival after the look changes it (no lost wake-up)
        message = self._deliver(self._next_arrival())
        if message is None:
            now = time.monotonic()
            self._check_polled_peers(now)
            if now < deadline:
                doorbell.wait(seen, min(deadline - now, self._peer_check_s))
        return message

    def _wait_on_inbox(self, deadline: float) -> Message | None:
        """Only threaded channels: a short spin on the inbox, then a condition-variable wait."""
        spin_until = time.monotonic() + SPIN_S
        while (item := self._inbox.get(0)) is None and time.monotonic() < spin_until:
            time.sleep(0)  # releases the GIL: the receiver thread can put what it has
        if item is None:
            item = self._inbox.get(max(0.0, deadline - time.monotonic()))
        return self._deliver(item)

    def _next_arrival(self) -> Message | ChannelFailure | None:
        """A message from a polled channel (round robin), else the inbox's next item, else None."""
        count = len(self._polled)
        for i in range(count):
            receiver = self._polled[(self._turn + i) % count]
            try:
                message = receiver.try_receive()
            except TransportError as exc:
                return ChannelFailure(exc)
            if message is not None:
                self._turn = (self._turn + i + 1) % count
                return message
        return self._inbox.get(0)

    def _check_polled_peers(self, now: float) -> None:
        """Dead-peer check of the polled channels (threaded ones check in their own threads)."""
        if not self._polled or now < self._next_peer_check:
            return
        self._next_peer_check = now + self._peer_check_s
        for receiver in self._polled:
            try:
                receiver.check_peer()
            except TransportError as exc:
                self._failure = exc
                raise

    def release(self, message: Message) -> None:
        token = message.token
        if isinstance(token, Delivery):
            token.channel.release(message)

    def landed(self, message: Message) -> bool:
        token = message.token
        landed = getattr(token.channel, "landed", None) if isinstance(token, Delivery) else None
        return True if landed is None else landed(message)

    def _release_undelivered(self) -> None:
        for item in self._inbox.drain():
            if isinstance(item, Message):
                item.token.channel.release(item)

    def _deliver(self, item: Message | ChannelFailure | None) -> Message | None:
        if isinstance(item, ChannelFailure):
            self._failure = item.error
            raise item.error
        if item is not None:
            try:
                item.token.channel.on_delivered(item)  # may wait for the payload (gloo/NCCL channels)
            except TransportError as exc:
                self._failure = exc
                raise
        return item

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError(f"rank {self.rank}: stage links are closed")
        if self._failure is not None:
            raise self._failure

    # ---- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Send end-of-stream on every outgoing channel, then wait for the peers' (each bounded by
        the timeout). Every rank of the pipeline should close; a dead peer does not block it."""
        if self._closed:
            return
        self._closed = True
        errors = []
        # After a failure (a peer died) its other channels may never see end-of-stream: a gloo
        # receive on a connection that was never used does not notice the death. Do not wait long.
        wait_s = self.timeout_s if self._failure is None else min(self.timeout_s, _CLOSE_AFTER_FAILURE_S)
        # Receivers first: undelivered messages are dropped and their slots freed, so a peer that is
        # blocked on our credits (or closing at the same time) can finish and send end-of-stream.
        for receiver in self._receivers:
            receiver.begin_close()
        self._release_undelivered()
        for channel in [*self._senders.values(), *self._receivers]:
            try:
                channel.close(wait_s)
            except TransportError as exc:  # keep closing the others: free every resource we can
                errors.append(str(exc))
        self._release_undelivered()
        if errors:
            log.warning("rank %d: %s", self.rank, problems_text(errors, "stage links closed with errors"))
