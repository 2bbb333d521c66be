"""Same-node channels for CUDA tensors: the sender copies straight into the receiver's GPU memory.

Per directed channel the receiver allocates K receive slots on its own GPU and shares them with the
sender through CUDA IPC (``torch.multiprocessing.reductions``, the mechanism torch's own
multiprocessing uses). A send is one device-to-device copy (NVLink between GPUs, or within one GPU)
issued on a side stream; nothing is staged through the host and nothing synchronises the host.

Ordering is carried by interprocess CUDA events, never by ``torch.cuda.synchronize``:

- ``filled[k]`` (sender's event): recorded on the side stream after the copy into slot k; the
  consumer's stream waits on it when ``poll``/``wait_any`` hands the message out;
- ``freed[k]`` (receiver's event): recorded on the consumer's stream by ``release``; the sender's
  side stream waits on it before it overwrites slot k.

Which slot is full, and the self-describing header, travel over the CPU shared-memory ring
(:mod:`trainer.transport.shm_links`), whose K slots are the K credits. The receiver is read by the
consumer's own thread exactly like a CPU shm one (no receiver thread): senders ring the receiving
rank's doorbell on commit and close, and ``wait_any`` sleeps on it and checks the peers' pids.

A payload larger than a slot is split over several slots and reassembled by the receiver into a
fresh tensor (one more device copy, queued by the consumer's thread on the receiver's copy stream).
Requirements: every rank sees the GPUs of its node (CUDA IPC across devices needs peer access, so
do not hide GPUs with CUDA_VISIBLE_DEVICES per rank); opening a peer's memory creates a CUDA context
on the peer's GPU in this process (a few hundred MiB there), the usual cost of CUDA IPC in torch.
"""

from __future__ import annotations

import logging

import torch
from torch.multiprocessing.reductions import reduce_tensor

from trainer.transport import _shm_ring
from trainer.transport.base import Direction, Message
from trainer.transport.channels import Delivery, Inbox
from trainer.transport.shm_links import ShmReceiver, ShmSender, all_gather, open_doorbells, open_rings
from trainer.transport.tensors import empty_bytes, from_bytes

logger = logging.getLogger(__name__)

_CONTROL_SLOT_BYTES = 64  # the control ring carries headers only; its payload area stays unused


class CudaIpcSender(ShmSender):
    """Outgoing half: side-stream copy into the peer's slot, event, then a header on the ring.

    The slot loop is :class:`ShmSender`'s; the ring here is the header-only control ring.
    """

    carries_payload = False

    def __init__(
        self, rank: int, peer: int, direction: Direction, control, remote_slots: torch.Tensor,
        freed: list[torch.cuda.Event], filled: list[torch.cuda.Event], device: torch.device, poll_s: float,
    ) -> None:  # fmt: skip
        super().__init__(rank, peer, direction, control, poll_s)
        self._remote_slots, self._device = remote_slots, device
        self._freed, self._filled = freed, filled
        self._stream = torch.cuda.Stream(device)

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device != self._device:
            raise ValueError(f"rank {self.rank}: this channel carries tensors on {self._device}, got {tensor.device}")

    def _slot_bytes(self) -> int:
        return self._remote_slots.shape[1]

    def _begin(self, data: torch.Tensor) -> None:
        # `data` was made on the producer's stream when a copy was needed: copy only what it finished.
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def _fill(self, slot: int, data: torch.Tensor, offset: int, length: int) -> None:
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._freed[slot])  # the consumer is done with slot k
            if length:
                self._remote_slots[slot, :length].copy_(data[offset : offset + length], non_blocking=True)
            self._filled[slot].record(self._stream)

    def _end(self, data: torch.Tensor) -> None:
        # The caching allocator must not hand `data` out again before the side stream read it.
        data.record_stream(self._stream)


class CudaIpcReceiver(ShmReceiver):
    """Incoming half, read by the consumer's own thread like its CPU base class (the control ring's
    headers, credits, ordering, dead-peer checks, draining and close are the same); only where the
    payload lives differs: the message's tensor is a view of the GPU slot, and the consumer's stream
    waits on the slot's "filled" event when ``poll``/``wait_any`` hands it out."""

    def __init__(
        self, rank: int, peer: int, direction: Direction, control: _shm_ring.Ring, slots: torch.Tensor,
        freed: list[torch.cuda.Event], filled: list[torch.cuda.Event], device: torch.device, poll_s: float,
        timeout_s: float,
    ) -> None:  # fmt: skip
        super().__init__(rank, peer, direction, control, poll_s, timeout_s)
        self._gpu_slots, self._device = slots, device
        self._freed, self._filled = freed, filled
        self._copy_stream = torch.cuda.Stream(device)  # only for reassembling oversized payloads

    def _message_at(self, slot: int) -> Message:
        frame = self._frame_at(slot)
        if frame.nbytes <= self._gpu_slots.shape[1]:  # also an empty payload: a view of the slot
            self._hold(slot, frame.sequence)
            view = from_bytes(self._gpu_slots[slot], frame.header)
            return Message(frame.header, view, self.peer, Delivery(self, ("slot", slot, frame.sequence)))
        with torch.cuda.stream(self._copy_stream):
            out = self._reassemble(slot, frame.nbytes, frame.sequence, empty_bytes(frame.nbytes, self._device))
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return Message(frame.header, from_bytes(out, frame.header), self.peer, Delivery(self, ("copy", done, out)))

    def _copy_chunk(self, slot: int, out: torch.Tensor, offset: int, length: int) -> None:
        """Queued on the copy stream after the sender's copy into the slot; the sender's next copy
        into it waits for this one through the "freed" event."""
        self._copy_stream.wait_event(self._filled[slot])
        out[offset : offset + length].copy_(self._gpu_slots[slot, :length], non_blocking=True)
        self._freed[slot].record(self._copy_stream)

    def on_delivered(self, message: Message) -> None:
        """In the consumer's thread: its current stream waits for the data (no host sync)."""
        consumer = torch.cuda.current_stream(self._device)
        handle = message.token.handle
        if handle[0] == "slot":
            consumer.wait_event(self._filled[handle[1]])
        else:
            consumer.wait_event(handle[1])
            handle[2].record_stream(consumer)  # allocated on the copy stream, used on the consumer's

    def release(self, message: Message) -> None:
        handle = message.token.handle
        if handle[0] != "slot":
            return  # a reassembled payload: the caching allocator owns its memory
        _, slot, sequence = handle
        self._unhold(slot, sequence)
        # Recorded before the slot goes back to the sender, whose next copy into it waits on this
        # event: it waits for everything the consumer queued so far.
        self._freed[slot].record(torch.cuda.current_stream(self._device))
        self._ring.release(slot)


def build_cuda_ipc_channels(
    specs: list, rank: int, device: torch.device, job: str, timeout_s: float, options, inbox: Inbox, group
) -> tuple[dict[Direction, CudaIpcSender], list[CudaIpcReceiver]]:
    """This rank's CUDA IPC senders and receivers. COLLECTIVE over ``group`` (all ranks)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    controls = open_rings(specs, rank, job, group, options.credits, _CONTROL_SLOT_BYTES)
    inbox.doorbell = open_doorbells(controls, rank, job, group)  # senders ring it on commit and close
    k, slot_bytes = options.credits, options.shm_slot_bytes
    mine: dict[tuple[int, int, str], dict] = {}
    local: dict[tuple[int, int, str], dict] = {}
    for key in controls:
        src, dst, _ = key
        events = [torch.cuda.Event(interprocess=True) for _ in range(k)]
        if dst == rank:  # receiver: owns the slots and the "freed" events
            slots = torch.empty(k, slot_bytes, dtype=torch.uint8, device=device)
            local[key] = {"slots": slots, "freed": events}
            mine[key] = {"slots": reduce_tensor(slots), "freed": [e.ipc_handle() for e in events]}
        else:  # sender: owns the "filled" events
            local[key] = {"filled": events}
            mine[key] = {"filled": [e.ipc_handle() for e in events]}
    shared: dict = {}
    for entry in all_gather(mine, group):
        for key, value in entry.items():
            shared.setdefault(key, {}).update(value)
    senders: dict[Direction, CudaIpcSender] = {}
    receivers = []
    poll_s = options.poll_interval_s
    for key, control in controls.items():
        src, dst, direction = key
        if src == rank:
            rebuild, args = shared[key]["slots"]
            # A peer's events are only waited on here (never recorded), so open them on our device.
            freed = [torch.cuda.Event.from_ipc_handle(device, h) for h in shared[key]["freed"]]
            senders[direction] = CudaIpcSender(
                rank, dst, direction, control, rebuild(*args), freed, local[key]["filled"], device, poll_s
            )
        else:
            filled = [torch.cuda.Event.from_ipc_handle(device, h) for h in shared[key]["filled"]]
            receivers.append(CudaIpcReceiver(
                rank, src, direction, control, local[key]["slots"], local[key]["freed"], filled, device,
                poll_s, timeout_s,
            ))  # fmt: skip
    return senders, receivers
