"""Torch-side helpers: a tensor as raw bytes and back, driven by a self-describing header.

Every transport moves bytes, never typed elements, so any dtype (bfloat16 and float8 included, which
gloo and numpy do not all support) crosses unchanged, and the header alone rebuilds the tensor.
"""

from __future__ import annotations

import threading

import torch

from trainer.transport.base import Header
from trainer.transport.wire import payload_nbytes, validate_header


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form a Header carries)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def header_for(tensor: torch.Tensor, kind: str, microbatch: int, chunk: int) -> Header:
    """The header that describes ``tensor`` (convenience for callers and tests)."""
    return Header(kind, microbatch, chunk, dtype_name(tensor.dtype), tuple(tensor.shape))  # type: ignore[arg-type]


def check_matches(tensor: torch.Tensor, header: Header) -> None:
    """ValueError unless ``header`` describes ``tensor`` exactly (a mismatch would corrupt the peer)."""
    validate_header(header)
    actual_dtype, actual_shape = dtype_name(tensor.dtype), tuple(tensor.shape)
    if header.dtype != actual_dtype or tuple(header.shape) != actual_shape:
        raise ValueError(
            f"header says dtype={header.dtype} shape={tuple(header.shape)} but the tensor has "
            f"dtype={actual_dtype} shape={actual_shape}"
        )


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s elements (copied first only if it is not contiguous)."""
    flat = tensor.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        # Not `.contiguous()`: a one-element tensor counts as contiguous whatever its stride, and a
        # uint8 view of a dtype wider than one byte needs stride 1 (found on GPU with x[::2] of 2 elements).
        flat = flat.new_empty(flat.shape).copy_(flat)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)


def from_bytes(raw: torch.Tensor, header: Header) -> torch.Tensor:
    """Typed view of the uint8 tensor ``raw`` (no copy) shaped as ``header`` says."""
    nbytes = payload_nbytes(header)
    dtype = torch_dtype(header.dtype)
    if nbytes == 0:
        return torch.empty(header.shape, dtype=dtype, device=raw.device)
    return raw[:nbytes].view(dtype).view(header.shape)


def empty_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class BufferPool:
    """Receive buffers handed back by ``release``, reused for payloads of the same size.

    A fresh multi-MiB CPU allocation costs a page fault per 4 KiB on first touch, on every message;
    reusing released buffers removes that. Holds at most ``limit`` buffers (sizes vary with the
    sequence length, so the newest are kept). CPU only: CUDA memory is the caching allocator's job.
    """

    def __init__(self, device: torch.device, limit: int) -> None:
        self._device, self._limit = device, limit
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.numel() == nbytes:
                    return self._free.pop(i)
        return empty_bytes(nbytes, self._device)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer the consumer no longer uses; ValueError if it was returned already."""
        if self._device.type != "cpu" or buffer.numel() == 0:
            return
        with self._lock:
            if any(b is buffer for b in self._free):
                raise ValueError("a received message was released twice")
            self._free.append(buffer)
            del self._free[: -self._limit]
