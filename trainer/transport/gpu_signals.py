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
waits for "freed >= n". Torch exposes neither driver call, so they are called through ctypes on
the driver library torch already loaded.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Protocol

import torch

log = logging.getLogger(__name__)

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: wait until (int32)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: with a memory barrier before the write


class Signals(Protocol):
    def signal(self, stream: torch.cuda.Stream, slot: int, count: int) -> None:
        """Queue on ``stream``: "slot's n-th use is done" (n = ``count``) for the peer."""

    def wait(self, stream: torch.cuda.Stream, slot: int, count: int) -> None:
        """Queue on ``stream``: block until the peer signalled ``count`` (or more) for ``slot``."""


class EventSignals:
    """Interprocess events: ``mine[k]`` is recorded here, ``theirs[k]`` (opened from the peer's
    handle on our device) is waited on. The count is implied by the last record."""

    def __init__(self, mine: list[torch.cuda.Event], theirs: list[torch.cuda.Event]) -> None:
        self.mine, self.theirs = mine, theirs

    def signal(self, stream: torch.cuda.Stream, slot: int, count: int) -> None:
        self.mine[slot].record(stream)

    def wait(self, stream: torch.cuda.Stream, slot: int, count: int) -> None:
        stream.wait_event(self.theirs[slot])  # never recorded yet: no wait, as a first fill needs


class FlagSignals:
    """Flags: ``peer_flags`` (the peer's memory, mapped in our context) is written, ``own_flags``
    (ours, int32, zero at start) is waited on."""

    def __init__(self, driver: StreamMemOps, peer_flags: torch.Tensor, own_flags: torch.Tensor) -> None:
        assert peer_flags.dtype == own_flags.dtype == torch.int32
        self._driver, self._peer, self._own = driver, peer_flags, own_flags

    def signal(self, stream: torch.cuda.Stream, slot: int, count: int) -> None:
        self._driver.write(stream, self._peer.data_ptr() + 4 * slot, count)

    def wait(self, stream: torch.cuda.Stream, slot: int, count: int) -> None:
        if count > 0:
            self._driver.wait_geq(stream, self._own.data_ptr() + 4 * slot, count)


class StreamMemOps:
    """``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` of the CUDA driver, via ctypes."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._write = _driver_function(lib, "cuStreamWriteValue32")
        self._wait = _driver_function(lib, "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        _check(self._write(stream.cuda_stream, address, value & 0xFFFFFFFF, _WRITE_DEFAULT), "cuStreamWriteValue32")

    def wait_geq(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        _check(self._wait(stream.cuda_stream, address, value & 0xFFFFFFFF, _WAIT_GEQ), "cuStreamWaitValue32")


def _driver_function(lib: ctypes.CDLL, name: str):
    # CUDA >= 11.7 headers map the name to its _v2 ABI (no device attribute needed); older drivers
    # have only the original symbol.
    func = getattr(lib, f"{name}_v2", None) or getattr(lib, name)
    func.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {code}")


def probe_stream_mem_ops(device: torch.device) -> StreamMemOps | None:
    """The driver's stream memory operations if they work on ``device`` (a write and a wait on a
    local flag, with one synchronize: set-up only); None where they do not."""
    device_index = device.index
    try:
        ops = StreamMemOps()
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        stream = torch.cuda.current_stream(device)
        ops.write(stream, flag.data_ptr(), 7)
        ops.wait_geq(stream, flag.data_ptr(), 7)
        torch.cuda.synchronize(device)
        if int(flag.item()) != 7:
            raise RuntimeError(f"flag reads {int(flag.item())} after writing 7")
        return ops
    except (OSError, AttributeError, RuntimeError) as exc:
        log.warning("cuda:%s: stream memory operations unavailable (%s)", device_index, exc)
        return None
