"""Same-node channels for CUDA tensors: the sender copies straight into the receiver's GPU memory.

Per directed channel the receiver allocates K receive slots on its own GPU and exports them with
CUDA IPC. The sender maps them **in its own CUDA context** (the handle is opened under the sender's
device, as NCCL does, with lazy peer access), so a send is a plain device-to-device ``cudaMemcpyAsync``
on the sender's side stream that the driver routes over NVLink (or stays within one GPU). Nothing is
staged through the host, nothing synchronises the host, and no process ever creates a CUDA context
on another process's GPU. (The first version rebuilt the slots through torch's IPC rebuild, which
opens the handle under the *receiver's* device: every sender then owned a second context on its
peer's GPU and every copy was a cross-device ``copy_`` with a two-way stream barrier on that foreign
context -- 21 GB/s at 8 MiB on 4xH200, a tenth of a peer copy.)

Ordering is carried by GPU-side signals (:mod:`trainer.transport.gpu_signals`), never by a host wait:
the sender's side stream signals "slot k filled" after its copy, and the consumer's stream waits for
it when ``poll``/``wait_any`` hands the message out; ``release`` signals "slot k freed" on the
consumer's stream, and the sender's next copy into k waits for that. Signals are 32-bit flags
written and awaited by the streams themselves (driver stream memory operations), or interprocess
CUDA events where the driver lacks those.

Which slot is full, and the self-describing header, travel over a header-only CPU shared-memory ring
(:mod:`trainer.transport.shm_links`), whose K slots are the K credits; the receiver reads it from the
consumer's own thread, like a CPU ring, and sleeps on the rank's doorbell. A payload larger than a
slot is split over several slots and reassembled by the receiver into a fresh tensor (one more
device copy, on the receiver's copy stream). Requirement: every rank sees the GPUs of its node (do
not hide GPUs with CUDA_VISIBLE_DEVICES per rank); peer access between them must be possible.
"""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from trainer.transport import _shm_ring
from trainer.transport.base import Direction, Header, Message, TransportError
from trainer.transport.channels import Delivery, Inbox
from trainer.transport.gpu_signals import (
    EventSignals,
    FlagSignals,
    Signals,
    current_stream_handle,
    device_context,
    made_event,
    probe_stream_mem_ops,
)
from trainer.transport.shm_links import (
    ShmReceiver,
    SlotView,
    _RingStatus,
    all_gather,
    open_doorbells,
    open_rings,
    send_in_slots,
)
from trainer.transport.tensors import as_bytes, check_matches, empty_bytes, from_bytes
from trainer.transport.wire import encode, pack

log = logging.getLogger(__name__)

_CONTROL_SLOT_BYTES = 64  # the control ring carries headers only; its payload area stays unused


class CudaPeerSender:
    """Outgoing half: a device-to-device copy on a side stream into the peer's slot, a "filled"
    signal, then the header on the control ring. The host never waits on the GPU; it waits only for
    a credit (a free slot on the control ring)."""

    def __init__(
        self, rank: int, peer: int, direction: Direction, control: _shm_ring.Ring, peer_slots: torch.Tensor,
        signals: Signals, device: torch.device, poll_s: float,
    ) -> None:  # fmt: skip
        assert peer_slots.device == device, "peer slots must be mapped in the sender's own context"
        self.rank, self.peer, self.direction = rank, peer, direction
        self._ring, self._poll_s = control, poll_s
        self._status = _RingStatus(rank, peer, direction, control)
        # The mapping is kept alive by self._peer_slots; sends use its raw address.
        self._peer_slots, self._device, self._signals = peer_slots, device, signals
        self._slots_base, self._slot_bytes = peer_slots.data_ptr(), peer_slots.stride(0)
        self._fills = [0] * peer_slots.shape[0]  # per slot: how often it was filled
        self._stream = torch.cuda.Stream(device)  # copies never queue behind this rank's compute
        self._order_event = made_event(self._stream)  # "the producer's work so far", per send; its raw
        self._order = self._order_event.cuda_event  # handle lives only as long as this torch object
        self._lock = threading.Lock()  # the chunks of one message must be consecutive slots
        self._sequence = 0
        self._closed = False

    def send(self, tensor: torch.Tensor, header: Header, timeout_s: float) -> None:
        check_matches(tensor, header)
        if tensor.get_device() != self._device.index:  # an int compare: no torch.device made per send
            raise ValueError(f"rank {self.rank}: this channel carries tensors on {self._device}, got {tensor.device}")
        # A contiguous tensor is sent from where it lies; otherwise as_bytes copies it on the
        # producer's stream first.
        data = tensor if tensor.is_contiguous() else as_bytes(tensor.detach())
        src, nbytes = data.data_ptr(), data.nbytes
        side, slot_bytes = self._stream.cuda_stream, self._slot_bytes
        producer = current_stream_handle(self._device.index)

        def fill(slot: int, offset: int, length: int) -> None:
            self._fills[slot] += 1
            # The first chunk orders the side stream after everything the producer queued so far
            # (copy only what was produced); then: after the consumer freed the slot's last fill,
            # copy, signal this fill. One driver round trip (gpu_signals.FlagSignals.fill).
            self._signals.fill(side, slot, self._fills[slot], self._slots_base + slot * slot_bytes, src + offset,
                               length, self._order if offset == 0 else 0, producer)  # fmt: skip

        with self._lock:
            if self._closed:
                raise TransportError(f"rank {self.rank}: {self.direction} channel to rank {self.peer} is closed")
            wire = pack(encode(header, self._sequence))
            # With flags the receiver's stream waits for "filled >= n", which only this fill writes,
            # so the header may go first. Not with events: a wait on an event not yet recorded for
            # this fill would pass on the previous record and read the slot's old bytes.
            send_in_slots(self._ring, self._status, wire, nbytes, slot_bytes, fill, timeout_s, self._poll_s,
                          external=True, commit_first=isinstance(self._signals, FlagSignals))  # fmt: skip
            # The caching allocator must not hand `data` out again before the side stream read it.
            if nbytes:
                data.record_stream(self._stream)
            self._sequence += 1

    def close(self, timeout_s: float) -> None:
        """End of stream (the receiver sees it on the control ring)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._ring.close()


@dataclass(frozen=True)
class GpuSlotView(SlotView):
    """A payload viewed in GPU slot ``slot``; ``fill`` counts the slot's fills, the value its
    "filled" and "freed" signals carry for this message."""

    fill: int


@dataclass(frozen=True)
class GpuCopy:
    """A payload reassembled into ``buffer`` on the copy stream; ``done`` is recorded after it."""

    done: Any  # torch.cuda.Event
    buffer: torch.Tensor


class CudaPeerReceiver(ShmReceiver):
    """Incoming half. Reading the control ring (headers, credits, ordering, dead-peer checks,
    draining, close) is the CPU ring reader's job, inherited; what differs is where the payload
    lives: the message's tensor is a view of the GPU slot, and the consumer's stream waits for the
    slot's "filled" signal when ``poll``/``wait_any`` hands it out."""

    def __init__(
        self, rank: int, peer: int, direction: Direction, control: _shm_ring.Ring, slots: torch.Tensor,
        signals: Signals, device: torch.device, poll_s: float, timeout_s: float,
    ) -> None:  # fmt: skip
        super().__init__(rank, peer, direction, control, poll_s, timeout_s)
        self._gpu_slots, self._device, self._signals = slots, device, signals
        self._arrivals = [0] * slots.shape[0]  # per slot: how often it arrived (= the fill it holds)
        self._slot_views = list(slots.unbind(0))  # made once: a slice costs microseconds per message
        self._typed: dict[tuple, torch.Tensor] = {}  # (slot, dtype, shape) -> typed view of the slot
        self._copy_stream = torch.cuda.Stream(device)  # only for reassembling oversized payloads

    def _arrive(self, slot: int) -> int:
        """The ring hands slots out in fill order, so the n-th arrival of a slot is its n-th fill."""
        self._arrivals[slot] += 1
        return self._arrivals[slot]

    def _message_at(self, slot: int) -> Message:
        frame = self._frame_at(slot)
        if frame.nbytes <= self._gpu_slots.shape[1]:  # also an empty payload: a view of the slot
            self._hold(slot, frame.sequence)
            view = self._typed_view(slot, frame.header)
            handle = GpuSlotView(slot, frame.sequence, self._arrive(slot))
            return Message(frame.header, view, self.peer, Delivery(self, handle))
        with torch.cuda.stream(self._copy_stream):
            out = self._reassemble(slot, frame.nbytes, frame.sequence, empty_bytes(frame.nbytes, self._device))
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return Message(frame.header, from_bytes(out, frame.header), self.peer, Delivery(self, GpuCopy(done, out)))

    def _typed_view(self, slot: int, header: Header) -> torch.Tensor:
        """A fresh tensor viewing ``slot`` as ``header`` says. A pipeline sends few distinct shapes,
        so the typed view is made once per slot and shape and each message gets a ``detach()`` of
        it: one tensor object instead of three (slice, dtype view, shape view) on the hot path, and
        never the same object twice (a consumer may set requires_grad on what it got)."""
        key = (slot, header.dtype, header.shape)
        typed = self._typed.get(key)
        if typed is None:
            if len(self._typed) >= 64 * len(self._slot_views):  # bounded whatever the shapes
                self._typed.clear()
            typed = self._typed[key] = from_bytes(self._slot_views[slot], header)
        return typed.detach()

    def _copy_chunk(self, slot: int, out: torch.Tensor, offset: int, length: int) -> None:
        """Queued on the copy stream after the sender's copy into the slot; the slot is freed (for
        the sender's next copy into it) as soon as this copy is done."""
        count = self._arrive(slot)
        copy_stream = self._copy_stream.cuda_stream
        self._signals.wait(copy_stream, slot, count)
        out[offset : offset + length].copy_(self._gpu_slots[slot, :length], non_blocking=True)
        self._signals.signal(copy_stream, slot, count)

    def on_delivered(self, message: Message) -> None:
        """The stream that first reads the tensor will wait for the data (no host sync): see
        :class:`Message` for why not the current stream now."""
        message.wait_when_used(lambda: self._wait_for_payload(message))

    def _wait_for_payload(self, message: Message) -> None:
        handle = message.token.handle
        if isinstance(handle, GpuSlotView):
            self._signals.wait(current_stream_handle(self._device.index), handle.slot, handle.fill)
        else:
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_event(handle.done)
            handle.buffer.record_stream(consumer)  # allocated on the copy stream, used on the consumer's

    def landed(self, message: Message) -> bool:
        """Whether the sender's copy of ``message`` into its slot is done (a host-side look at the
        "filled" signal; StageLinks.landed)."""
        handle = message.token.handle
        if isinstance(handle, GpuSlotView):
            return self._signals.signalled(handle.slot, handle.fill)
        return handle.done.query()

    def release(self, message: Message) -> None:
        handle = message.token.handle
        if not isinstance(handle, GpuSlotView):
            return  # a reassembled payload: the caching allocator owns its memory
        self._unhold(handle.slot, handle.sequence)
        # Queued before the slot goes back to the sender, whose next copy into it waits for this
        # signal: it follows everything the consumer queued so far.
        self._signals.signal(current_stream_handle(self._device.index), handle.slot, handle.fill)
        self._ring.release(handle.slot)


def build_cuda_peer_channels(
    specs: list, rank: int, device: torch.device, job: str, timeout_s: float, options, inbox: Inbox, group
) -> tuple[dict[Direction, CudaPeerSender], list[CudaPeerReceiver]]:
    """This rank's same-node GPU senders and receivers. COLLECTIVE over ``group`` (all ranks)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    controls = open_rings(specs, rank, job, group, options.credits, _CONTROL_SLOT_BYTES)
    inbox.doorbell = open_doorbells(controls, rank, job, group)  # senders ring it on commit and close
    flags_work_here = options.gpu_signals != "events" and probe_stream_mem_ops(device)
    use_flags = all(all_gather(flags_work_here, group))  # one kind of signal on every channel
    if options.gpu_signals == "flags" and not use_flags:
        raise TransportError(f"rank {rank}: gpu_signals='flags' but some rank's driver has no stream "
                             "memory operations (see the warning); use 'auto' or 'events'")
    k, slot_bytes = options.credits, options.shm_slot_bytes
    mine: dict[tuple[int, int, str], dict] = {}
    local: dict[tuple[int, int, str], dict] = {}
    for key in controls:
        src, dst, _ = key
        # Each endpoint owns what the *other* side signals to it: flags it waits on (zeroed, in
        # its own memory) or the events it records.
        if use_flags:
            flags = torch.zeros(k, dtype=torch.int32, device=device)
            local[key] = {"own": flags}
            mine[key] = {"flags" + ("@dst" if dst == rank else "@src"): reduce_tensor(flags)}
        else:
            events = [torch.cuda.Event(interprocess=True) for _ in range(k)]
            local[key] = {"own": events}
            mine[key] = {"events" + ("@dst" if dst == rank else "@src"): [e.ipc_handle() for e in events]}
        if dst == rank:  # the receiver owns the slots
            slots = torch.empty(k, slot_bytes, dtype=torch.uint8, device=device)
            local[key]["slots"] = slots
            mine[key]["slots"] = reduce_tensor(slots)
    torch.cuda.synchronize(device)  # the zeroed flags exist before any peer can write them
    shared: dict = {}
    for entry in all_gather(mine, group):
        for key, value in entry.items():
            shared.setdefault(key, {}).update(value)
    senders: dict[Direction, CudaPeerSender] = {}
    receivers = []
    poll_s = options.poll_interval_s
    context = device_context(device)
    for key, control in controls.items():
        src, dst, direction = key
        peer_side = "@dst" if src == rank else "@src"
        if use_flags:
            signals: Signals = FlagSignals(context, map_in_own_context(shared[key]["flags" + peer_side], device),
                                           local[key]["own"])  # fmt: skip
        else:  # a peer's events are only waited on here (never recorded), so open them on our device
            theirs = [torch.cuda.Event.from_ipc_handle(device, h) for h in shared[key]["events" + peer_side]]
            signals = EventSignals(context, local[key]["own"], theirs)
        if src == rank:
            senders[direction] = CudaPeerSender(
                rank, dst, direction, control, map_in_own_context(shared[key]["slots"], device), signals,
                device, poll_s,
            )
        else:
            receivers.append(CudaPeerReceiver(
                rank, src, direction, control, local[key]["slots"], signals, device, poll_s, timeout_s,
            ))  # fmt: skip
    return senders, receivers


def map_in_own_context(shared_slots: tuple, device: torch.device) -> torch.Tensor:
    """The peer's exported slots as a tensor of *our* device: torch's rebuild with the storage device
    replaced by ours, so the IPC handle is opened in this process's own context (lazy peer access)
    and copies into it are same-context device-to-device copies. With torch's default (the exporter's
    device) this process would create a context on the peer's GPU and copy across devices."""
    rebuild, args = shared_slots
    bound = inspect.signature(rebuild).bind(*args)
    bound.arguments["storage_device"] = device.index
    return rebuild(*bound.args, **bound.kwargs)
