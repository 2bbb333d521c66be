"""Same-node channels over the C++ shared-memory ring (``trainer.transport._shm_ring``), CPU tensors.

One ring per directed channel, named ``/mdpp-<job>-<src>-<dst>-<direction>`` and created by the
receiver (it owns the K slots, mode 0600); the sender attaches and unlinks the name at once, so
after set-up nothing is left in /dev/shm even if a process is killed.

Copies: the sender copies the tensor's bytes into a slot (the one copy); the receiver's tensor is a
view of that slot until :meth:`StageLinks.release`. A payload larger than a slot is split over
consecutive slots and reassembled into a fresh tensor on the receiver (a second copy, so size the
slots for the common payload).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.names import doorbell_name, ring_name
from trainer.problems import problems_text
from trainer.transport import _shm_ring
from trainer.transport.base import Direction, Header, Message, TransportError, TransportTimeout
from trainer.transport.channels import Delivery, Inbox
from trainer.transport.tensors import BufferPool, as_bytes, check_matches, empty_bytes, from_bytes
from trainer.transport.wire import Frame, decode, encode, pack, unpack

log = logging.getLogger(__name__)

_WAIT_SLICE_S = 1.0  # a receiving/draining thread re-checks for close() at least this often while idle


@dataclass(frozen=True)
class SlotView:
    """``Message.token.handle`` of a payload viewed in place: ring slot ``slot`` holds message
    ``sequence`` until released."""

    slot: int
    sequence: int


@dataclass(frozen=True)
class PooledCopy:
    """``Message.token.handle`` of a payload reassembled into ``buffer``, a pool buffer handed back
    on release."""

    buffer: torch.Tensor


class _RingStatus:
    """Turns the ring's negative wait codes into errors that name this rank, the peer and the wait."""

    def __init__(self, rank: int, peer: int, direction: Direction, ring: _shm_ring.Ring) -> None:
        self.rank, self.peer, self.direction, self._ring = rank, peer, direction, ring

    def error(self, code: int, waiting_for: str, timeout_s: float) -> TransportError:
        where = f"rank {self.rank} waiting for {waiting_for} on the {self.direction} channel with rank {self.peer}"
        if code == _shm_ring.PEER_DEAD:
            return TransportError(f"{where}: peer rank {self.peer} (pid {self._ring.peer_pid}) died")
        if code == _shm_ring.PEER_CLOSED:
            return TransportError(f"{where}: peer rank {self.peer} closed its end")
        return TransportTimeout(f"{where}: nothing after {timeout_s:.1f}s")


def send_in_slots(
    ring: _shm_ring.Ring, status: _RingStatus, wire, nbytes: int, slot_bytes: int,
    fill: Callable[[int, int, int], None], timeout_s: float, poll_s: float, external: bool,
    commit_first: bool = False,
) -> None:  # fmt: skip
    """The slot loop of every ring-based sender: take a credit (a free slot), let ``fill(slot, offset,
    length)`` put that chunk's bytes where the payload lives, commit the header (wakes the receiver).
    At least one slot, also for an empty payload; a payload larger than a slot takes consecutive
    slots (the caller holds its send lock so the chunks of one message are never interleaved).
    ``external``: the ring carries only headers (the payload lives in GPU slots). ``commit_first``:
    commit before filling -- only where the receiver's use of the slot waits for a signal that the
    fill itself raises (GPU flags), so the receiver's host starts on the header while ours is still
    queueing the copy."""
    offset = 0
    while True:
        slot = ring.acquire(timeout_s, poll_s)
        if slot < 0:
            raise status.error(slot, "a free receive slot (credit)", timeout_s)
        length = min(slot_bytes, nbytes - offset)
        if commit_first:
            ring.commit(slot, length, wire, external=external)
            fill(slot, offset, length)
        else:
            fill(slot, offset, length)
            ring.commit(slot, length, wire, external=external)
        offset += length
        if offset >= nbytes:
            return


class ShmSender:
    """Outgoing half: copy into the next free slot(s), then commit (wakes the receiver)."""

    def __init__(self, rank: int, peer: int, direction: Direction, ring: _shm_ring.Ring, poll_s: float) -> None:
        self.rank, self.peer, self.direction = rank, peer, direction
        self._ring, self._poll_s = ring, poll_s
        self._status = _RingStatus(rank, peer, direction, ring)
        self._lock = threading.Lock()  # the chunks of one message must be consecutive slots
        self._sequence = 0
        self._closed = False

    def send(self, tensor: torch.Tensor, header: Header, timeout_s: float) -> None:
        check_matches(tensor, header)
        if tensor.device.type != "cpu":
            raise ValueError(f"rank {self.rank}: the shm ring carries CPU tensors, got one on {tensor.device}")
        data = as_bytes(tensor.detach())

        def fill(slot: int, offset: int, length: int) -> None:
            if length:
                self._ring.write(slot, 0, data.data_ptr() + offset, length)

        with self._lock:
            if self._closed:
                raise TransportError(f"rank {self.rank}: {self.direction} channel to rank {self.peer} is closed")
            wire = pack(encode(header, self._sequence))
            send_in_slots(self._ring, self._status, wire, data.numel(), self._ring.slot_bytes, fill,
                          timeout_s, self._poll_s, external=False)
            self._sequence += 1

    def close(self, timeout_s: float) -> None:
        """End of stream: committed slots stay readable in the receiver's mapping."""
        with self._lock:  # after any send in progress on another thread
            if not self._closed:
                self._closed = True
                self._ring.close()


class ShmReceiver:
    """Incoming half, read by the consumer's own thread (a :class:`PolledReceiver`): ``try_receive``
    takes the next full slot if there is one and hands out a view of it. Waiting happens on the
    rank's doorbell in :meth:`ChannelStageLinks.wait_any`, so no receiver thread and no hand-off.
    The ring's K slots are the credits: nothing is read ahead of the consumer."""

    def __init__(
        self, rank: int, peer: int, direction: Direction, ring: _shm_ring.Ring, poll_s: float, timeout_s: float,
    ) -> None:  # fmt: skip
        self.rank, self.peer, self.direction = rank, peer, direction
        self._ring, self._poll_s, self._timeout_s = ring, poll_s, timeout_s
        self._status = _RingStatus(rank, peer, direction, ring)
        self._slots = torch.frombuffer(ring, dtype=torch.uint8)  # keeps the mapping alive
        self._held: dict[int, int] = {}  # slot -> sequence of the message viewing it
        self._held_lock = threading.Lock()  # release() may come from another thread
        self._pool = BufferPool(torch.device("cpu"), ring.num_slots)  # for payloads larger than a slot
        self._expected = 0
        self._ended = False  # the sender's end of stream was seen
        self._closing = False
        self._drainer: threading.Thread | None = None  # frees arrivals from begin_close() on

    def try_receive(self) -> Message | None:
        if self._ended or self._closing:
            return None
        slot = self._ring.poll_full()
        if slot == _shm_ring.PEER_CLOSED:
            self._ended = True
            return None
        if slot < 0:
            return None
        try:
            return self._message_at(slot)
        except TransportError:
            raise
        except Exception as exc:  # corrupt header etc.: one clear error naming the channel
            detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise TransportError(
                f"rank {self.rank}: receiving from rank {self.peer} ({self.direction} channel) failed: {detail}"
            ) from exc

    def check_peer(self) -> None:
        if not self._ended and self._ring.peer_status() == _shm_ring.PEER_DEAD:
            raise self._status.error(_shm_ring.PEER_DEAD, "the next message", self._poll_s)

    def on_delivered(self, message: Message) -> None:
        """Nothing to do: the ring's slots are the credits."""

    def _frame_at(self, slot: int) -> Frame:
        """The decoded header of the message starting in ``slot``; it must be the one due next."""
        frame = decode(unpack(self._ring.slot_header(slot)))
        if frame.header is None or frame.sequence != self._expected:
            raise TransportError(
                f"rank {self.rank}: message {frame.sequence} from rank {self.peer} arrived when "
                f"{self._expected} was due"
            )
        self._expected += 1
        return frame

    def _message_at(self, slot: int) -> Message:
        frame = self._frame_at(slot)
        if frame.nbytes == 0:
            self._ring.release(slot)
            return Message(frame.header, from_bytes(empty_bytes(0, torch.device("cpu")), frame.header), self.peer, Delivery(self))
        if frame.nbytes <= self._ring.slot_bytes:  # the common case: a zero-copy view of the slot
            start = self._ring.slot_offset(slot)
            self._hold(slot, frame.sequence)
            view = from_bytes(self._slots[start : start + frame.nbytes], frame.header)
            return Message(frame.header, view, self.peer, Delivery(self, SlotView(slot, frame.sequence)))
        out = self._reassemble(slot, frame.nbytes, frame.sequence, self._pool.take(frame.nbytes))
        return Message(frame.header, from_bytes(out, frame.header), self.peer, Delivery(self, PooledCopy(out)))

    def _hold(self, slot: int, sequence: int) -> None:
        """``slot`` is viewed by message ``sequence`` until :meth:`release`."""
        with self._held_lock:
            self._held[slot] = sequence

    def _unhold(self, slot: int, sequence: int) -> None:
        """End the view of :meth:`_hold`; ValueError if that message was released already."""
        with self._held_lock:
            if self._held.get(slot) != sequence:
                raise ValueError(
                    f"rank {self.rank}: message {sequence} from rank {self.peer} was already released"
                )
            del self._held[slot]

    def _next_chunk(self, sequence: int, offset: int, nbytes: int) -> int:
        """Slot of the next chunk of a message whose first chunk arrived (the sender is mid-send)."""
        slot = self._ring.wait_full(self._timeout_s, self._poll_s)
        if slot == _shm_ring.PEER_CLOSED:
            raise TransportError(
                f"rank {self.rank}: rank {self.peer} ended the stream in the middle of message "
                f"{sequence} ({offset} of {nbytes} bytes received)"
            )
        if slot < 0:
            raise self._status.error(slot, f"the rest of message {sequence}", self._timeout_s)
        return slot

    def _reassemble(self, slot: int, nbytes: int, sequence: int, out: torch.Tensor) -> torch.Tensor:
        """Copy the chunks of one oversized message out of consecutive slots into ``out``."""
        offset = 0
        while True:
            length = self._ring.slot_nbytes(slot)
            self._copy_chunk(slot, out, offset, length)
            self._ring.release(slot)
            offset += length
            if offset >= nbytes:
                return out
            slot = self._next_chunk(sequence, offset, nbytes)
            if decode(unpack(self._ring.slot_header(slot))).sequence != sequence:
                raise TransportError(f"rank {self.rank}: chunks of message {sequence} from rank {self.peer} interleaved")

    def _copy_chunk(self, slot: int, out: torch.Tensor, offset: int, length: int) -> None:
        """Copy ``length`` bytes of ``slot`` to ``out[offset:]``; the slot is freed right after."""
        self._ring.read(slot, 0, out.data_ptr() + offset, length)

    def release(self, message: Message) -> None:
        handle = message.token.handle
        if handle is None:
            return  # an empty payload: nothing behind it
        if isinstance(handle, PooledCopy):  # a reassembled payload: its buffer serves a later one
            try:
                self._pool.give_back(handle.buffer)
            except ValueError as exc:
                raise ValueError(f"rank {self.rank}: from rank {self.peer}: {exc}") from None
            return
        self._unhold(handle.slot, handle.sequence)
        self._ring.release(handle.slot)

    def begin_close(self) -> None:
        """From now on arrivals are dropped (their slots freed) by a short-lived drain thread, so a
        peer blocked on our credits can finish its sends and its close while ours are in progress."""
        if self._drainer is None:
            self._closing = True
            self._drainer = threading.Thread(
                target=self._drain_to_end, name=f"mdpp-drain-{self.peer}-{self.rank}-{self.direction}", daemon=True
            )
            self._drainer.start()

    def _drain_to_end(self) -> None:
        """Free every arriving slot until the peer's end of stream, its death, or our own ring close."""
        while not self._ended:
            slot = self._ring.wait_full(_WAIT_SLICE_S, self._poll_s)
            if slot >= 0:
                self._ring.release(slot)  # nobody will consume it: the sender may need the credit
            elif slot == _shm_ring.PEER_CLOSED:  # also what our own ring.close() makes it return
                self._ended = True
            elif slot == _shm_ring.PEER_DEAD:
                return  # a dead peer does not block close

    def close(self, timeout_s: float) -> None:
        """Wait for the peer's end of stream (or its death) for up to ``timeout_s``, then unmap."""
        self.begin_close()
        self._drainer.join(timeout_s)
        try:
            if self._drainer.is_alive():
                self._ring.close()  # wakes the drain thread out of its wait
                self._drainer.join(2 * _WAIT_SLICE_S)
                raise TransportTimeout(
                    f"rank {self.rank}: rank {self.peer} did not close its {self.direction} channel "
                    f"within {timeout_s:.1f}s"
                )
        finally:
            self._ring.close()
            self._ring.unlink()  # normally a no-op: the sender unlinked it when it attached


def _set_up_in_phases(phases: tuple[tuple[str, Callable[[], None]], ...], rank: int, group,
                      clean_up: Callable[[], None]) -> None:
    """Run the set-up ``phases`` in order on every rank. COLLECTIVE over ``group``.

    An all-gather after each phase keeps every rank from starting the next one (attaching to a name)
    before every rank finished this one (created it); and when a phase failed anywhere, every rank
    runs ``clean_up`` and raises one TransportError naming each rank's error, instead of waiting for
    peers that will never attach. When the all-gather itself fails (a rank died, or never came within the
    group's timeout), this rank cleans up what it made and raises TransportError naming the phase;
    the segments the missing rank made are its caller's to remove (trainer.launch.run_token.remove_run_segments).
    """
    for phase, work in phases:
        error = None
        try:
            work()
        except (OSError, RuntimeError, ValueError) as exc:
            error = f"rank {rank}: {exc}"
            if "No space" in error:
                error += " (/dev/shm too small? lower LinkOptions.shm_slot_bytes or credits)"
        try:
            errors = all_gather(error, group)
        except RuntimeError as exc:  # a peer died (its sockets closed) or never came (the group's timeout)
            clean_up()
            raise TransportError(f"rank {rank}: shared-memory set-up ({phase}): not every rank finished "
                                 f"this phase (one died, failed outside it, or never came): {exc}") from exc
        if any(errors):
            clean_up()
            raise TransportError(problems_text(errors, f"shared-memory set-up ({phase}) failed"))


def _discard(rings: dict[tuple[int, int, str], _shm_ring.Ring]) -> None:
    """Unmap and unlink every ring (after a failed set-up)."""
    for ring in rings.values():
        ring.close()
        ring.unlink()


def open_rings(
    specs: list, rank: int, job: str, group, num_slots: int, slot_bytes: int
) -> dict[tuple[int, int, str], _shm_ring.Ring]:
    """Create (as receiver) then attach (as sender) this rank's rings. COLLECTIVE over ``group``.

    Two all-gathers separate the phases, so no sender opens a name before it exists, and a failure
    on any rank makes every rank raise instead of waiting for peers that will never attach.
    """
    rings: dict[tuple[int, int, str], _shm_ring.Ring] = {}

    def create() -> None:
        for s in specs:
            if s.dst == rank:
                name = ring_name(job, s.src, s.dst, s.direction)
                rings[s.src, s.dst, s.direction] = _shm_ring.Ring.create(name, num_slots, slot_bytes)

    def attach() -> None:
        for s in specs:
            if s.src == rank:
                rings[s.src, s.dst, s.direction] = _shm_ring.Ring.attach(ring_name(job, s.src, s.dst, s.direction))

    _set_up_in_phases((("create", create), ("attach", attach)), rank, group, lambda: _discard(rings))
    for (src, dst, _), ring in rings.items():
        if dst == rank:
            ring.unlink()  # the sender did already; make sure nothing can outlive a crash now
        if not ring.pid_checks_possible:
            log.warning(
                "rank %d: ranks %d and %d are in different pid namespaces: a dead peer is noticed "
                "only by timeout", rank, src, dst,
            )  # fmt: skip
    return rings


def all_gather(obj, group) -> list:
    """Every rank's ``obj`` (collective over ``group``, which spans all ranks)."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def open_doorbells(
    rings: dict[tuple[int, int, str], _shm_ring.Ring], rank: int, job: str, group
) -> _shm_ring.Doorbell | None:
    """Create this rank's doorbell (if it receives on any ring) and hook every ring it sends on to its
    receiver's doorbell. COLLECTIVE over ``group``; returns this rank's own doorbell, or None.

    Same two phases as :func:`open_rings`; the owner unlinks the name once every sender attached, and a
    last all-gather keeps any rank from returning before every name is gone.
    """
    own: list[_shm_ring.Doorbell] = []

    def create() -> None:
        if any(dst == rank for _, dst, _ in rings):
            own.append(_shm_ring.Doorbell.create(doorbell_name(job, rank)))

    def attach() -> None:
        bells: dict[int, _shm_ring.Doorbell] = {}
        for (src, dst, _), ring in rings.items():
            if src == rank:
                if dst not in bells:
                    bells[dst] = _shm_ring.Doorbell.attach(doorbell_name(job, dst))
                ring.set_doorbell(bells[dst])  # the ring keeps the doorbell mapped

    def clean_up() -> None:
        for bell in own:
            bell.unlink()
        _discard(rings)

    _set_up_in_phases((("create doorbell", create), ("attach doorbell", attach)), rank, group, clean_up)
    for bell in own:
        bell.unlink()  # every sender has it mapped: nothing can outlive a crash now
    all_gather(None, group)  # no rank returns while another's doorbell name is still visible
    return own[0] if own else None


def build_shm_channels(
    specs: list, rank: int, job: str, timeout_s: float, options, inbox: Inbox, group,
) -> tuple[dict, list]:  # fmt: skip
    """This rank's shm senders (by direction) and receivers for CPU tensors. COLLECTIVE over ``group``.

    (CUDA tensors take :mod:`trainer.transport.cuda_peer`, which uses these rings for headers only.)
    """
    rings = open_rings(specs, rank, job, group, options.credits, options.shm_slot_bytes)
    inbox.doorbell = open_doorbells(rings, rank, job, group)
    senders: dict[Direction, ShmSender] = {}
    receivers: list[ShmReceiver] = []
    for (src, dst, direction), ring in rings.items():
        if src == rank:
            senders[direction] = ShmSender(rank, dst, direction, ring, options.poll_interval_s)
        else:
            receivers.append(ShmReceiver(rank, src, direction, ring, options.poll_interval_s, timeout_s))
    return senders, receivers
