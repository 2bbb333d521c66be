"""Completion and progress of posted gloo/NCCL operations, for the channels of trainer/transport/dist_links.py.

A posted operation's completion is looked at without blocking (:class:`NcclDone`: the work's CUDA
event; :class:`GlooDone`: a flag a :class:`GlooWatcher` thread raises, since gloo's works report
completion only to a wait). Every wait of the channels is :func:`await_done`, which keeps calling
:meth:`DistProgress.pump` -- the rank's receivers post the payload receives their peers announced
-- so a rank blocked in a send still lets its peers' sends complete. :class:`HeaderBell` is the
doorbell of a rank that receives only on polled header lines.
"""

from __future__ import annotations

import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

from trainer.transport.channels import SPIN_S


class Receiver(Protocol):
    """What the progress and the bell use of a ProcessGroupReceiver (trainer/transport/dist_links.py)."""

    @property
    def reading(self) -> bool: ...  # the header line may still deliver

    @property
    def line(self): ...  # noqa: ANN201 - the header line (its fileno() is polled)

    def post_announced(self) -> None: ...


MAX_PAUSE_S = 1e-3  # longest sleep between two looks at an unfinished operation


# ---- completion of one posted operation -------------------------------------------------------------
class GlooDone:
    """Completion flag of a gloo work, raised by a :class:`GlooWatcher`."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: Exception | None = None

    def done(self) -> bool:
        if not self._event.is_set():
            return False
        if self.error is not None:
            raise self.error
        return True

    def pause(self, seconds: float) -> None:
        self._event.wait(seconds)  # wakes at once when the work completes

    def set(self, error: Exception | None) -> None:
        self.error = error
        self._event.set()


class NcclDone:
    """Completion of an NCCL work: its CUDA event, queried without blocking the host."""

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def done(self) -> bool:
        if not self.work.is_completed():
            return False
        self.work.wait()  # raises the work's error, if any (orders the current stream, no host wait)
        return True

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)


def await_done(dones: list, deadline: float, pump: Callable[[], None]) -> bool:
    """True once every completion in ``dones`` is done; False at ``deadline``. Calls ``pump()``
    between looks, pausing 20 us .. 1 ms (no core spins)."""
    pause = 20e-6
    for item in dones:
        while not item.done():
            if time.monotonic() >= deadline:
                return False
            pump()
            item.pause(pause)
            pause = min(pause * 2, MAX_PAUSE_S)
    return True


class GlooWatcher:
    """Completion flags for gloo works of one channel end.

    gloo's ``Work.is_completed()`` stays False until someone waits on the work, and a gloo wait that
    times out closes the connection; so a daemon thread waits the works in posting order and raises
    one flag per work, which the consumer can look at without blocking.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def watch(self, work: dist.Work) -> GlooDone:
        done = GlooDone()
        self._queue.put((work, done))
        return done

    def stop(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            work, done = item
            try:
                work.wait()
                done.set(None)
            except Exception as exc:  # the connection failed: this and every later work report it
                done.set(exc)


class DistProgress:
    """The gloo/NCCL receivers of one rank and the lock under which the rank issues its operations.

    :meth:`pump` posts the payload receives of announced messages (up to the credits of each
    channel); every wait in this module calls it, so a rank blocked in a send still lets its peers'
    sends complete.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._receivers: list[Receiver] = []

    def add(self, receiver: Receiver) -> None:
        with self.lock:
            self._receivers.append(receiver)

    def remove(self, receiver: Receiver) -> None:
        with self.lock:
            if receiver in self._receivers:
                self._receivers.remove(receiver)

    def pump(self) -> None:
        with self.lock:
            for receiver in self._receivers:
                receiver.post_announced()


class HeaderBell:
    """The doorbell (see ``channels.Doorbell``) of a rank whose incoming channels are all polled
    header lines: ``wait`` returns once a line that may still deliver has bytes (or has ended),
    after a spin of non-blocking looks (``channels.SPIN_S``, 100 us), like the shared-memory rings'
    doorbell. There is no counter: a look at readiness never misses an arrival, so ``seq`` stays 0."""

    seq = 0

    def __init__(self, receivers: list[Receiver]) -> None:
        self._receivers = receivers
        self._watch()

    def ring(self) -> None:
        """Nothing to ring: arrivals show as readable lines."""

    def _watch(self) -> None:
        """Register the lines that may still deliver (an ended line stays readable: not it)."""
        self._poller = select.poll()
        self._watched = {}
        for receiver in self._receivers:
            if receiver.reading:
                fd = receiver.line.fileno()
                self._poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
                self._watched[fd] = receiver

    def _poll(self, timeout_ms: float) -> bool:
        # Lines only ever stop reading, so the watched set is a superset of the live one and misses
        # no arrival; it is rebuilt only when a line that stopped reading shows up as ready, so a
        # look that finds nothing costs one poll call.
        while self._watched:
            ready = self._poller.poll(timeout_ms)
            if all(self._watched[fd].reading for fd, _ in ready):
                return bool(ready)
            self._watch()
        time.sleep(timeout_ms / 1e3)
        return False

    def wait(self, seen: int, timeout_s: float) -> bool:
        spin_until = time.monotonic() + min(timeout_s, SPIN_S)
        while time.monotonic() < spin_until:
            if self._poll(0):
                return True
        return self._poll(max(timeout_s, 0.0) * 1e3)


def describe_error(exc: Exception) -> str:
    """An error's first line (gloo's and NCCL's messages run on for pages)."""
    text = str(exc)
    return text.splitlines()[0] if text else repr(exc)


class FailedDone:
    """Completion of an operation that could not even be posted."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def done(self) -> bool:
        raise self.error

    def pause(self, seconds: float) -> None:  # pragma: no cover - done() raises first
        time.sleep(seconds)
