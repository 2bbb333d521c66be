"""Fixed-size wire encoding of a :class:`~trainer.transport.base.Header` (shared by every transport).

A message is this header (16 little-endian int64 words, 128 bytes) followed by the payload's raw
bytes. A fixed size lets a receiver pre-post the header receive before it knows anything about the
payload, and lets the shared-memory ring keep the header in a fixed place of each slot.

Word layout::

    0  magic | version        6..13  shape (up to MAX_DIMS dims, unused ones 0)
    1  flags (kind, end-of-stream)   14  payload size in bytes
    2  microbatch                    15  sequence number within the channel (ordering check)
    3  chunk
    4  dtype code (index in DTYPE_NAMES)
    5  ndim
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

from trainer.problems import raise_if_any
from trainer.transport.base import Header, TransportError

HEADER_WORDS = 16
HEADER_BYTES = HEADER_WORDS * 8
MAX_DIMS = 8
_MAGIC = 0x4D445050_0001  # "MDPP", wire version 1
_FLAG_GRAD = 1
_FLAG_END_OF_STREAM = 2
_STRUCT = struct.Struct(f"<{HEADER_WORDS}q")

# Append only: the index of a name is its code on the wire.
DTYPE_NAMES = (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
_DTYPE_CODE = {name: code for code, name in enumerate(DTYPE_NAMES)}
_ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}  # fmt: skip


class Frame(NamedTuple):
    """A decoded header word block: the header (None for end-of-stream), payload size, sequence.
    (A tuple: built once per message on the receive path, where a frozen dataclass's field-by-field
    ``__init__`` cost microseconds on the GPU hosts.)"""

    header: Header | None
    nbytes: int
    sequence: int

    @property
    def end_of_stream(self) -> bool:
        return self.header is None


_KINDS = ("act", "grad")


def payload_nbytes(header: Header) -> int:
    """Bytes of the payload that ``header`` describes."""
    return math.prod(header.shape) * _ITEMSIZE[header.dtype]


def validate_header(header: Header) -> None:
    """Raise ValueError naming every field a peer could not decode."""
    shape = header.shape
    if (header.kind in _KINDS and header.dtype in _ITEMSIZE and len(shape) <= MAX_DIMS
            and min(shape, default=0) >= 0 and header.microbatch >= 0 and header.chunk >= 0):  # fmt: skip
        return  # the common case, checked without building a list (once per message sent)
    problems = []
    if header.kind not in _KINDS:
        problems.append(f"kind={header.kind!r} (expected 'act' or 'grad')")
    if header.dtype not in _ITEMSIZE:
        problems.append(f"dtype={header.dtype!r} (supported: {', '.join(DTYPE_NAMES)})")
    if len(header.shape) > MAX_DIMS:
        problems.append(f"shape={header.shape} has more than {MAX_DIMS} dims")
    if any(d < 0 for d in header.shape):
        problems.append(f"shape={header.shape} has a negative dim")
    if header.microbatch < 0 or header.chunk < 0:
        problems.append(f"microbatch={header.microbatch}, chunk={header.chunk} must be >= 0")
    raise_if_any(problems, "header cannot be sent")


def encode(header: Header | None, sequence: int) -> list[int]:
    """Header words for ``header`` (None encodes end-of-stream, sent by ``close``)."""
    words = [0] * HEADER_WORDS
    words[0] = _MAGIC
    words[15] = sequence
    if header is None:
        words[1] = _FLAG_END_OF_STREAM
        return words
    words[1] = _FLAG_GRAD if header.kind == "grad" else 0
    words[2] = header.microbatch
    words[3] = header.chunk
    words[4] = _DTYPE_CODE[header.dtype]
    words[5] = len(header.shape)
    words[6 : 6 + len(header.shape)] = header.shape
    words[14] = payload_nbytes(header)
    return words


def decode(words: list[int] | tuple[int, ...]) -> Frame:
    """Inverse of :func:`encode`; TransportError on a corrupt or foreign block."""
    if len(words) != HEADER_WORDS or words[0] != _MAGIC:
        raise TransportError(f"corrupt header on the wire: {list(words)[:4]}...")
    if words[1] & _FLAG_END_OF_STREAM:
        return Frame(None, 0, words[15])
    ndim, code = words[5], words[4]
    if not (0 <= ndim <= MAX_DIMS and 0 <= code < len(DTYPE_NAMES)):
        raise TransportError(f"corrupt header on the wire: ndim={ndim} dtype code={code}")
    # Headers are immutable and a pipeline sends few distinct ones (kinds x microbatches x chunks x
    # shapes), so one object per distinct header is shared instead of a dataclass built per message.
    key = tuple(words[1 : 6 + ndim])
    header = _DECODED.get(key)
    if header is None:
        header = Header(
            kind="grad" if words[1] & _FLAG_GRAD else "act",
            microbatch=words[2],
            chunk=words[3],
            dtype=DTYPE_NAMES[code],
            shape=tuple(words[6 : 6 + ndim]),
        )
        if len(_DECODED) >= _DECODED_LIMIT:  # bounded whatever the traffic
            _DECODED.clear()
        _DECODED[key] = header
    return Frame(header, words[14], words[15])


_DECODED: dict[tuple, Header] = {}
_DECODED_LIMIT = 4096


def pack(words: list[int]) -> bytes:
    return _STRUCT.pack(*words)


def unpack(raw: bytes | memoryview) -> tuple[int, ...]:
    return _STRUCT.unpack(raw)
