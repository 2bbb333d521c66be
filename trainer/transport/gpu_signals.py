"""How two processes tell each other, GPU-side, that a receive slot was filled or freed.

Each endpoint of a same-node GPU channel (:mod:`trainer.transport.cuda_peer`) *signals* its own
news on one of its streams (the sender: "slot k filled", after its copy; the receiver: "slot k
freed", after the consumer's last use) and makes a stream *wait* for the peer's news. Both are
queued on streams; the host never waits. Two ways:

- :class:`FlagSignals` (default where the driver allows it): one 32-bit flag per slot in the waiting
  side's GPU memory. The signalling side writes the slot's use count into the peer's flag with
  ``cuStreamWriteValue32`` (ordered after its copy, with a memory barrier) through a mapping in its
  own context; the waiting side's stream blocks in ``cuStreamWaitValue32(>= count)``. The GPU front
  end resolves these directly: a few microseconds.
- :class:`EventSignals`: interprocess CUDA events (record / ``cudaStreamWaitEvent``). Works
  everywhere, but a wait on another process's event took ~100 us to resolve on H200s, which capped
  an 8 MiB channel at ~0.65x a peer copy.

Counts: the n-th fill of slot k is signalled as n; the receiver, whose ring hands slots out in the
order they were filled, knows it is waiting for n, and frees it as n; the sender's next fill of k
waits for "freed >= n". Torch exposes neither driver call; the C++ extension ``_cuda_hop``
(csrc/cuda_hop.cpp) calls them, and issues a whole send -- order after the producer, wait for
"freed", copy, signal "filled" -- in one call with the GIL released: done through torch and ctypes
the send was 90-120 us of host time per hop on the GPU hosts here, most of a hop's latency.

Streams and events are passed as raw handles (``current_stream_handle``, ``Stream.cuda_stream``,
``Event.cuda_event``): creating torch stream objects and entering stream contexts costs several
microseconds each on these hosts.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from trainer.transport import _cuda_hop

log = logging.getLogger(__name__)

SNAPSHOT_S = 30e-6
"""FlagSignals.signalled: a host copy of the flags younger than this is reused (one decision of the
runtime asks about every gradient in transit)."""
PROBE_WAIT_S = 0.2e-3
"""FlagSignals.signalled: longest host wait for the flags' copy before answering "landed"."""


def current_stream_handle(device_index: int) -> int:
    """The raw handle of the current stream of ``device_index`` (no torch Stream object made)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def device_context(device: torch.device) -> int:
    """The raw primary context of ``device``, which every ``_cuda_hop`` call makes current for its
    duration (the calling thread may have another device current)."""
    return _cuda_hop.primary_context(device.index)


def made_event(stream: torch.cuda.Stream, **kwargs) -> torch.cuda.Event:
    """A torch event whose CUDA event exists (torch creates it lazily, at the first record)."""
    event = torch.cuda.Event(**kwargs)
    event.record(stream)
    if not event.cuda_event:
        raise RuntimeError("torch did not create the CUDA event at its first record")
    return event


class Signals(Protocol):
    def signal(self, stream: int, slot: int, count: int) -> None:
        """Queue on ``stream``: "slot's n-th use is done" (n = ``count``) for the peer."""

    def wait(self, stream: int, slot: int, count: int) -> None:
        """Queue on ``stream``: block until the peer signalled ``count`` (or more) for ``slot``."""

    def fill(self, stream: int, slot: int, count: int, dst: int, src: int, nbytes: int,
             order: int = 0, producer: int = 0) -> None:  # fmt: skip
        """Queue the ``count``-th fill of ``slot`` on ``stream``: after event ``order`` recorded on
        ``producer`` (if given), after the peer freed fill ``count - 1``, copy ``nbytes`` from
        ``src`` to ``dst``, then signal ``count``."""

    def signalled(self, slot: int, count: int) -> bool:
        """Host side, never blocking for long: has the peer's signal ``count`` for ``slot`` been
        given on the GPU yet? A scheduling hint (``StageLinks.landed``); True when it cannot tell."""


class EventSignals:
    """Interprocess events: ``mine[k]`` is recorded here, ``theirs[k]`` (opened from the peer's
    handle on our device) is waited on. The count is implied by the last record."""

    def __init__(self, context: int, mine: list[torch.cuda.Event], theirs: list[torch.cuda.Event]) -> None:
        self._context = context
        self._mine = [e.cuda_event for e in mine]
        self._theirs = [e.cuda_event for e in theirs]
        self._keep = (mine, theirs)  # the raw handles live as long as the torch events
        if not all(self._mine) or not all(self._theirs):
            raise RuntimeError("interprocess events must exist before signalling (ipc_handle creates them)")

    def signal(self, stream: int, slot: int, count: int) -> None:
        _cuda_hop.record_event(self._context, self._mine[slot], stream)

    def wait(self, stream: int, slot: int, count: int) -> None:
        _cuda_hop.wait_event(self._context, stream, self._theirs[slot])  # never recorded yet: no wait, as a first fill needs

    def signalled(self, slot: int, count: int) -> bool:
        # The sender records the slot's event before it posts the header (see CudaPeerSender.send),
        # so the event's last record is this fill's.
        return self._keep[1][slot].query()

    def fill(self, stream: int, slot: int, count: int, dst: int, src: int, nbytes: int,
             order: int = 0, producer: int = 0) -> None:  # fmt: skip
        if order:
            _cuda_hop.record_event(self._context, order, producer)
            _cuda_hop.wait_event(self._context, stream, order)
        self.wait(stream, slot, count - 1)
        _cuda_hop.copy(self._context, stream, dst, src, nbytes)
        self.signal(stream, slot, count)


class FlagSignals:
    """Flags: ``peer_flags`` (the peer's memory, mapped in our context) is written, ``own_flags``
    (ours, int32, zero at start) is waited on."""

    def __init__(self, context: int, peer_flags: torch.Tensor, own_flags: torch.Tensor) -> None:
        assert peer_flags.dtype == own_flags.dtype == torch.int32
        self._context = context
        self._peer, self._own = peer_flags.data_ptr(), own_flags.data_ptr()
        self._keep = (peer_flags, own_flags)  # the addresses live as long as the tensors
        self._snapshot: torch.Tensor | None = None  # pinned host copy of own_flags (signalled())
        self._snapshot_values = None  # its numpy view, read without a torch call per look
        self._snapshot_at = -1.0
        self._probe_stream: torch.cuda.Stream | None = None
        self._probe_done: torch.cuda.Event | None = None

    def signalled(self, slot: int, count: int) -> bool:
        # Our flags live in GPU memory: read them through a small copy on a side stream of their
        # own (never behind this rank's compute), at most once per SNAPSHOT_S, waiting <= PROBE_WAIT_S.
        if self._snapshot is None:
            own = self._keep[1]
            self._snapshot = torch.empty(own.shape, dtype=own.dtype, pin_memory=True)
            self._snapshot_values = self._snapshot.numpy()
            self._probe_stream = torch.cuda.Stream(own.device)
            self._probe_done = torch.cuda.Event()
        now = time.monotonic()  # after the first call's set-up, which is slower than PROBE_WAIT_S
        if now - self._snapshot_at <= SNAPSHOT_S:
            return bool(self._snapshot_values[slot] >= count)
        with torch.cuda.stream(self._probe_stream):
            self._snapshot.copy_(self._keep[1], non_blocking=True)
            self._probe_done.record()
        deadline = now + PROBE_WAIT_S
        while not self._probe_done.query():
            if time.monotonic() > deadline:
                return True  # cannot tell in time: as if landed (the schedule's old behaviour)
        self._snapshot_at = time.monotonic()
        return bool(self._snapshot_values[slot] >= count)

    def signal(self, stream: int, slot: int, count: int) -> None:
        _cuda_hop.write(self._context, stream, self._peer + 4 * slot, count)

    def wait(self, stream: int, slot: int, count: int) -> None:
        if count > 0:
            _cuda_hop.wait_geq(self._context, stream, self._own + 4 * slot, count)

    def fill(self, stream: int, slot: int, count: int, dst: int, src: int, nbytes: int,
             order: int = 0, producer: int = 0) -> None:  # fmt: skip
        _cuda_hop.flagged_copy(self._context, stream, order, producer, self._own + 4 * slot, count - 1, dst, src, nbytes,
                               self._peer + 4 * slot, count)  # fmt: skip


def probe_stream_mem_ops(device: torch.device) -> bool:
    """Whether the driver's stream memory operations work on ``device`` (a write and a wait on a
    local flag, with one synchronize: set-up only)."""
    device_index = device.index
    try:
        problem = _cuda_hop.available()
        if problem:
            raise RuntimeError(problem)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        stream, context = torch.cuda.current_stream(device).cuda_stream, device_context(device)
        _cuda_hop.write(context, stream, flag.data_ptr(), 7)
        _cuda_hop.wait_geq(context, stream, flag.data_ptr(), 7)
        torch.cuda.synchronize(device)
        if int(flag.item()) != 7:
            raise RuntimeError(f"flag reads {int(flag.item())} after writing 7")
        return True
    except RuntimeError as exc:
        log.warning("cuda:%s: stream memory operations unavailable (%s)", device_index, exc)
        return False
