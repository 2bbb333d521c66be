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
(:mod:`trainer.transport.shm_links`), whose K slots are the K credits and whose futex waits give
``wait_any`` its no-spin blocking and its dead-peer detection.

A payload larger than a slot is split over several slots and reassembled by the receiver into a
fresh tensor (one more device copy, on the receiver's copy stream). Requirements: every rank sees
the GPUs of its node (CUDA IPC across devices needs peer access, so do not hide GPUs with
CUDA_VISIBLE_DEVICES per rank); opening a peer's memory creates a CUDA context on the peer's GPU in
this process (a few hundred MiB there), the usual cost of CUDA IPC in torch.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch.multiprocessing.reductions import reduce_tensor

from trainer.transport import _shm_ring
from trainer.transport.base import Direction, Header, Message, TransportError
from trainer.transport.channels import Delivery, Inbox, ThreadedReceiver
from trainer.transport.shm_links import _WAIT_SLICE_S, _RingStatus, all_gather, open_rings
from trainer.transport.tensors import as_bytes, check_matches, empty_bytes, from_bytes
from trainer.transport.wire import decode, encode, pack, unpack

logger = logging.getLogger(__name__)

_CONTROL_SLOT_BYTES = 64  # the control ring carries headers only; its payload area stays unused


class CudaIpcSender:
    """Outgoing half: side-stream copy into the peer's slot, event, then a header on the ring."""

    def __init__(
        self, rank: int, peer: int, direction: Direction, control, remote_slots: torch.Tensor,
        freed: list[torch.cuda.Event], filled: list[torch.cuda.Event], device: torch.device, poll_s: float,
    ) -> None:  # fmt: skip
        self.rank, self.peer, self.direction = rank, peer, direction
        self._control, self._remote_slots, self._device, self._poll_s = control, remote_slots, device, poll_s
        self._freed, self._filled = freed, filled
        self._status = _RingStatus(rank, peer, direction, control)
        self._stream = torch.cuda.Stream(device)
        self._lock = threading.Lock()
        self._sequence = 0
        self._closed = False

    def send(self, tensor: torch.Tensor, header: Header, timeout_s: float) -> None:
        check_matches(tensor, header)
        if tensor.device != self._device:
            raise ValueError(f"rank {self.rank}: this channel carries tensors on {self._device}, got {tensor.device}")
        data = as_bytes(tensor.detach())  # on the producer's stream when a copy is needed
        producer = torch.cuda.current_stream(self._device)
        slot_bytes, nbytes = self._remote_slots.shape[1], data.numel()
        with self._lock:
            if self._closed:
                raise TransportError(f"rank {self.rank}: {self.direction} channel to rank {self.peer} is closed")
            wire = pack(encode(header, self._sequence))
            self._stream.wait_stream(producer)  # copy only what the producer has finished writing
            offset = 0
            while True:
                slot = self._control.acquire(timeout_s, self._poll_s)
                if slot < 0:
                    raise self._status.error(slot, "a free receive slot (credit)", timeout_s)
                length = min(slot_bytes, nbytes - offset)
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._freed[slot])  # the consumer is done with slot k
                    if length:
                        self._remote_slots[slot, :length].copy_(data[offset : offset + length], non_blocking=True)
                    self._filled[slot].record(self._stream)
                self._control.commit(slot, length, wire, external=True)  # payload is on the GPU
                offset += length
                if offset >= nbytes:
                    break
            # The caching allocator must not hand `data` out again before the side stream read it.
            data.record_stream(self._stream)
            self._sequence += 1

    def close(self, timeout_s: float) -> None:
        with self._lock:  # after any send in progress on another thread
            if not self._closed:
                self._closed = True
                self._control.close()


class CudaIpcReceiver(ThreadedReceiver):
    """Incoming half: the thread waits for headers; the slot itself is handed out as a view."""

    def __init__(
        self, rank: int, peer: int, direction: Direction, control, slots: torch.Tensor,
        freed: list[torch.cuda.Event], filled: list[torch.cuda.Event], device: torch.device,
        credits: int, inbox: Inbox, poll_s: float,
    ) -> None:  # fmt: skip
        super().__init__(rank, peer, direction, inbox, credits)
        self._control, self._slots, self._device, self._poll_s = control, slots, device, poll_s
        self._freed, self._filled = freed, filled
        self._status = _RingStatus(rank, peer, direction, control)
        self._copy_stream = torch.cuda.Stream(device)  # only for reassembling oversized payloads
        self._expected = 0
        self._held: dict[int, int] = {}
        self._held_lock = threading.Lock()

    def _on_thread_start(self) -> None:
        torch.cuda.set_device(self._device)

    def _interrupt(self) -> None:
        self._control.close()

    def _next_slot(self) -> int | None:
        while not self._abandon.is_set():
            slot = self._control.wait_full(_WAIT_SLICE_S, self._poll_s)
            if slot >= 0:
                return slot
            if slot == _shm_ring.PEER_CLOSED:  # end of stream
                return None
            if slot != _shm_ring.TIMEOUT:  # an idle peer is fine; a dead one is not
                raise self._status.error(slot, "the next message", _WAIT_SLICE_S)
        return None

    def _receive_one(self) -> Message | None:
        slot = self._next_slot()
        if slot is None:
            return None
        frame = decode(unpack(self._control.slot_header(slot)))
        if frame.header is None or frame.sequence != self._expected:
            raise TransportError(
                f"rank {self.rank}: message {frame.sequence} from rank {self.peer} arrived when {self._expected} was due"
            )
        self._expected += 1
        if frame.nbytes <= self._slots.shape[1]:
            with self._held_lock:
                self._held[slot] = frame.sequence
            view = from_bytes(self._slots[slot], frame.header)
            return Message(frame.header, view, self.peer, Delivery(self, ("slot", slot, frame.sequence)))
        out, done = self._reassemble(slot, frame.nbytes, frame.sequence)
        return Message(frame.header, from_bytes(out, frame.header), self.peer, Delivery(self, ("copy", done, out)))

    def _reassemble(self, slot: int, nbytes: int, sequence: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        with torch.cuda.stream(self._copy_stream):
            out = empty_bytes(nbytes, self._device)
            offset = 0
            while True:
                length = self._control.slot_nbytes(slot)
                self._copy_stream.wait_event(self._filled[slot])
                out[offset : offset + length].copy_(self._slots[slot, :length], non_blocking=True)
                self._freed[slot].record(self._copy_stream)
                self._control.release(slot)
                offset += length
                if offset >= nbytes:
                    break
                slot = self._next_slot()
                if slot is None:
                    raise TransportError(
                        f"rank {self.rank}: rank {self.peer} ended the stream in the middle of message {sequence}"
                    )
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return out, done

    def on_delivered(self, message: Message) -> None:
        """In the consumer's thread: its current stream waits for the data (no host sync)."""
        consumer = torch.cuda.current_stream(self._device)
        handle = message.token.handle
        if handle[0] == "slot":
            consumer.wait_event(self._filled[handle[1]])
        else:
            consumer.wait_event(handle[1])
            handle[2].record_stream(consumer)  # allocated on the copy stream, used on the consumer's
        super().on_delivered(message)

    def release(self, message: Message) -> None:
        handle = message.token.handle
        if handle[0] != "slot":
            return
        _, slot, sequence = handle
        with self._held_lock:
            if self._held.get(slot) != sequence:
                raise ValueError(f"rank {self.rank}: message {sequence} from rank {self.peer} was already released")
            del self._held[slot]
        # The sender's next copy into this slot waits for everything the consumer queued so far.
        self._freed[slot].record(torch.cuda.current_stream(self._device))
        self._control.release(slot)

    def close(self, timeout_s: float) -> None:
        try:
            super().close(timeout_s)
        finally:
            self._control.close()


def build_cuda_ipc_channels(
    specs: list, rank: int, device: torch.device, job: str, options, inbox: Inbox, group
) -> tuple[dict[Direction, CudaIpcSender], list[CudaIpcReceiver]]:
    """This rank's CUDA IPC senders and receivers. COLLECTIVE over ``group`` (all ranks)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    controls = open_rings(specs, rank, job, group, options.credits, _CONTROL_SLOT_BYTES)
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
            receiver = CudaIpcReceiver(
                rank, src, direction, control, local[key]["slots"], local[key]["freed"], filled, device,
                options.credits, inbox, poll_s,
            )  # fmt: skip
            receiver.start()
            receivers.append(receiver)
    return senders, receivers
