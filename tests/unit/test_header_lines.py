"""Header lines (trainer.transport.header_lines): the TCP connections that carry the gloo/NCCL
channels' headers. Real sockets on the loopback interface; the collective set-up is exercised by
tests/dist/test_transport_dist_protocol.py and the node-split DPP tests."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from trainer.transport.base import TransportError, TransportTimeout
from trainer.transport.header_lines import (
    _HELLO,
    HeaderLine,
    _accept,
    _connect,
    advertised_address,
    listen_any,
)


def _listener() -> tuple[socket.socket, tuple[str, int]]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    return listener, listener.getsockname()


def test_headers_arrive_whole_and_in_order_and_a_closed_peer_is_named():
    listener, address = _listener()
    got: dict = {}

    def accept():
        got.update(_accept(listener, {(0, 1, "next"), (2, 1, "prev")}, 1, time.monotonic() + 5, 5.0))

    thread = threading.Thread(target=accept)
    thread.start()
    deadline = time.monotonic() + 5
    first = _connect((0, 1, "next"), 0, address, deadline, 5.0)
    second = _connect((2, 1, "prev"), 2, address, deadline, 5.0)
    thread.join(5)
    assert sorted(got) == [(0, 1, "next"), (2, 1, "prev")]
    assert got[(0, 1, "next")].peer == 0 and got[(2, 1, "prev")].peer == 2
    frames = [bytes([i]) * 128 for i in range(50)]
    for frame in frames:
        first.send(frame, 5.0)
    assert [got[(0, 1, "next")].receive(128) for _ in frames] == frames
    first.close()
    with pytest.raises(TransportError, match=r"rank 1: rank 0 closed its next channel's header line without an end of stream"):
        got[(0, 1, "next")].receive(128)
    second.close()
    got[(2, 1, "prev")].close()
    listener.close()


def test_a_send_to_a_peer_that_stopped_reading_times_out_and_one_to_a_dead_peer_fails():
    mine, theirs = socket.socketpair()
    line = HeaderLine(mine, 3, 4, "prev")
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"rank 3: header to rank 4 \(prev channel\) not taken within 0.2s"):
        for _ in range(1_000_000):  # fills both kernel buffers, then the send timeout fires
            line.send(b"h" * 128, 0.2)
    assert time.monotonic() - start < 3
    theirs.close()
    with pytest.raises(TransportError, match=r"rank 3: sending a header to rank 4 \(prev channel\) failed, peer rank 4 is probably dead"):
        line.send(b"h" * 128, 0.2)
    line.close()


def test_accept_names_the_edges_that_never_connected_and_ignores_strangers(caplog):
    listener, address = _listener()
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"rank 1: header lines of edge\(s\) 0->1 \(next\) not connected within 0.3s"):
        _accept(listener, {(0, 1, "next")}, 1, time.monotonic() + 0.3, 0.3)
    assert time.monotonic() - start < 2
    # A stray connection with a wrong hello, one that closes at once, then the real rank: the stray
    # ones are logged and closed, the real one is accepted.
    stranger = socket.create_connection(address)
    stranger.sendall(_HELLO.pack(0x1234, 7, 1, 0))
    quitter = socket.create_connection(address)
    quitter.close()
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(_accept(listener, {(0, 1, "next")}, 1, time.monotonic() + 5, 5.0)))
    with caplog.at_level("WARNING"):
        thread.start()
        real = _connect((0, 1, "next"), 0, address, time.monotonic() + 5, 5.0)
        thread.join(5)
    assert list(got) == [(0, 1, "next")]
    assert "ignored a header line connection" in caplog.text and "edge 7->1" in caplog.text, caplog.text
    assert "closed before its hello" in caplog.text, caplog.text
    for s in (stranger, real, got[(0, 1, "next")]):
        s.close()
    listener.close()


def test_connect_to_nobody_times_out_naming_the_edge_and_address():
    listener, address = _listener()
    listener.close()  # nothing listens there now
    with pytest.raises(TransportTimeout, match=r"rank 0: could not connect the header line of edge 0->1 \(next\) to rank 1 at 127.0.0.1"):
        _connect((0, 1, "next"), 0, address, time.monotonic() + 0.3, 0.3)
    with pytest.raises(TransportError, match=r"rank 1 has no header listener"):
        _connect((0, 1, "next"), 0, None, time.monotonic() + 0.3, 0.3)


def test_advertised_address_prefers_the_explicit_setting_then_the_route_to_master(monkeypatch):
    monkeypatch.setenv("MDPP_HEADER_ADDR", "10.1.2.3")
    assert advertised_address() == "10.1.2.3"
    monkeypatch.delenv("MDPP_HEADER_ADDR")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert advertised_address() == "127.0.0.1"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_listener_takes_lines_from_ipv4_and_ipv6_addresses(host, monkeypatch):
    """Ranks may advertise either family (MDPP_HEADER_ADDR, or the route to an IPv6 MASTER_ADDR):
    one listener serves both."""
    if host == "::1" and not _has_ipv6_loopback():
        pytest.skip("this host has no IPv6 loopback")
    monkeypatch.delenv("MDPP_HEADER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", host)
    assert advertised_address() == host
    listener = listen_any()
    address = (advertised_address(), listener.getsockname()[1])
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(
        _accept(listener, {(0, 1, "next")}, 1, time.monotonic() + 5, 5.0)))
    thread.start()
    line = _connect((0, 1, "next"), 0, address, time.monotonic() + 5, 5.0)
    thread.join(5)
    line.send(b"x" * 128, 5.0)
    assert got[(0, 1, "next")].receive(128) == b"x" * 128
    line.close()
    got[(0, 1, "next")].close()
    listener.close()


def test_a_failed_connect_names_an_ipv6_peer_with_brackets():
    with pytest.raises(TransportTimeout, match=r"rank 1 at \[::1\]:1 within"):
        _connect((0, 1, "next"), 0, ("::1", 1), time.monotonic() + 0.2, 0.2)


class _FakeReceiver:
    """What HeaderBell looks at: whether the line may still deliver, and the line's descriptor."""

    def __init__(self, sock: socket.socket) -> None:
        self.line, self.reading = sock, True


def test_header_bell_wakes_on_a_header_and_never_busy_waits_on_an_ended_line():
    from trainer.transport.dist_progress import HeaderBell

    mine, theirs = socket.socketpair()
    receiver = _FakeReceiver(mine)
    bell = HeaderBell([receiver])
    start = time.monotonic()
    assert bell.wait(bell.seq, 0.2) is False  # nothing came: sleeps its whole timeout
    assert 0.15 < time.monotonic() - start < 1.0
    threading.Timer(0.05, lambda: theirs.sendall(b"h" * 128)).start()
    start = time.monotonic()
    assert bell.wait(bell.seq, 5.0) is True  # woken by the arrival, not by the timeout
    assert time.monotonic() - start < 1.0
    mine.recv(128)
    theirs.close()  # the peer's end of stream: the line is readable (EOF) for ever after
    assert bell.wait(bell.seq, 0.2) is True  # the end itself is news: the receiver reads it
    receiver.reading = False  # ... and stops reading: the bell must not keep waking on the EOF
    cpu, start = time.process_time(), time.monotonic()
    assert bell.wait(bell.seq, 0.3) is False
    assert time.monotonic() - start > 0.25 and time.process_time() - cpu < 0.1
    mine.close()
