"""A polled header line has two readers: the consumer (``try_receive``) and any thread pumping the
rank's progress (``post_announced``, e.g. a sender waiting for credit). CI once saw "message 36 from
rank 1 arrived when 35 was due" because two unserialised reads appended their chunks out of order.
This test forces that interleaving: the first read has taken its bytes off the
line and is held there until a second thread has started its own read -- which must wait, so the
headers still decode in order."""

from __future__ import annotations

import threading

import torch

from trainer.transport.base import Header
from trainer.transport.channels import Inbox
from trainer.transport.dist_links import PolledGroupReceiver
from trainer.transport.dist_progress import DistProgress
from trainer.transport.edge_groups import EdgeGroup
from trainer.transport.wire import HEADER_BYTES, encode, pack


def _header_bytes(sequence: int) -> bytes:
    return pack(encode(Header("act", sequence, 0, "float32", (2,)), sequence))


class _HeldLine:
    """A header line whose first read_available() returns its bytes only after another thread has
    begun a read (or 2 s passed); later reads return the next chunk at once."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks
        self._calls = 0
        self._lock = threading.Lock()
        self.first_read_started = threading.Event()
        self.second_reader_started = threading.Event()

    def read_available(self) -> bytes:
        with self._lock:
            self._calls += 1
            call = self._calls
            chunk = self._chunks.pop(0) if self._chunks else b""
        if call == 1:
            self.first_read_started.set()
            self.second_reader_started.wait(2.0)
            # hold the bytes a moment longer: an unserialised second read would append first
            threading.Event().wait(0.2)
        return chunk


def test_two_threads_reading_a_polled_line_keep_its_headers_in_order() -> None:
    raw = b"".join(_header_bytes(i) for i in range(3))
    # message 0 whole plus half of message 1 in the first chunk, the rest in the second
    cut = HEADER_BYTES + HEADER_BYTES // 2
    line = _HeldLine([raw[:cut], raw[cut:]])
    edge = EdgeGroup(src=1, dst=0, direction="next", header=line, payload=None, backend="nccl")  # type: ignore[arg-type]
    receiver = PolledGroupReceiver(0, edge, torch.device("cpu"), credits=4, inbox=Inbox(),
                                   progress=DistProgress(), timeout_s=5.0)
    first_got: list = []
    first = threading.Thread(target=lambda: first_got.append(receiver.try_receive()))
    first.start()
    assert line.first_read_started.wait(5.0)

    second_failure: list[BaseException] = []

    def second_reader() -> None:
        line.second_reader_started.set()
        try:
            receiver.check_peer()  # reads the line too
        except BaseException as exc:  # noqa: BLE001 - reported below
            second_failure.append(exc)

    second = threading.Thread(target=second_reader)
    second.start()
    first.join(5.0)
    second.join(5.0)
    assert not first.is_alive() and not second.is_alive()
    assert second_failure == []
    got = []
    while (message := receiver.try_receive()) is not None:
        got.append(message.header.microbatch)
    assert [first_got[0].header.microbatch, *got] == [0, 1, 2]
