"""One TCP connection per directed gloo/NCCL edge, carrying that edge's 128-byte message headers.

Why not gloo (which carried them before): on the CPU machine a gloo ``isend`` call
alone took 44 us and a 128-byte gloo ping-pong 237 us per round trip, and completion needed a
watcher thread per channel end (gloo's ``is_completed`` stays False until someone waits); the whole
gloo/NCCL hop was ~0.9 ms per round trip on both the CPU machine and the 4xH100 host. A header is a
fixed 128 bytes written once and read in order by one thread: a plain stream socket with
``TCP_NODELAY`` does exactly that, and a peer that dies closes it at once (the receiver's read ends,
the sender's write fails), which gloo reported only at its timeout.

Set-up (:func:`connect_header_lines`) is COLLECTIVE over every rank: each rank that receives on
some edge listens on an ephemeral port, the addresses are exchanged with one ``all_gather_object``
on a gloo group, then every rank connects its outgoing edges (the listeners' kernels complete the
handshakes before anyone accepts, so the order cannot deadlock) and accepts its incoming ones,
each connection identified by a hello naming its edge. Every step is bounded by ``timeout_s`` and
an error names the rank, the peer and the edge.

The address a rank advertises: ``MDPP_HEADER_ADDR`` if set, else the local address of the route to
``MASTER_ADDR`` (the interface the job's rendezvous already reaches other nodes through), else the
host name's address. IPv4 or IPv6 alike: the listener is dual-stack where the kernel allows it
(one IPv6 socket that also accepts IPv4), so a rank may advertise either family.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import struct
import time

import torch.distributed as dist

from trainer.transport.base import Direction, TransportError, TransportTimeout

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<qqqq")  # magic, src, dst, direction code
_HELLO_MAGIC = 0x4D445050_4844  # "MDPP" "HD"
_DIRECTIONS: tuple[Direction, ...] = ("next", "prev")

EdgeKey = tuple[int, int, Direction]


class HeaderLine:
    """One end of an edge's header connection: the sender writes whole headers, the receiver's
    header thread reads them, in order."""

    def __init__(self, sock: socket.socket, rank: int, peer: int, direction: Direction) -> None:
        sock.settimeout(None)  # blocking: a Python-level timeout polls before every send (~5 us)
        self._sock, self.rank, self.peer, self.direction = sock, rank, peer, direction
        self._closed = False
        self._send_timeout: float | None = None
        self._received = bytearray()  # receive's buffer (sized at first use)
        self._received_view = memoryview(self._received)

    def send(self, data: bytes, timeout_s: float) -> None:
        """Write one header; bounded by ``timeout_s`` (it only blocks if the peer stopped reading)."""
        try:
            if timeout_s != self._send_timeout:  # the kernel's send timeout: no poll per header
                seconds = int(timeout_s)
                micros = int((timeout_s - seconds) * 1e6)
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, micros))
                self._send_timeout = timeout_s
            self._sock.sendall(data)
        except (TimeoutError, BlockingIOError):
            raise TransportTimeout(
                f"rank {self.rank}: header to rank {self.peer} ({self.direction} channel) not taken "
                f"within {timeout_s:.1f}s: rank {self.peer} stopped reading headers"
            ) from None
        except OSError as exc:
            raise TransportError(
                f"rank {self.rank}: sending a header to rank {self.peer} ({self.direction} channel) failed, "
                f"peer rank {self.peer} is probably dead: {exc}"
            ) from exc

    def receive(self, nbytes: int) -> bytes:
        """Block until ``nbytes`` arrived (no timeout: a peer may have nothing to send for long).
        TransportError when the connection ends first -- the peer process is gone."""
        if len(self._received) != nbytes:  # one buffer per line, reused: only its header thread reads
            self._received = bytearray(nbytes)
            self._received_view = memoryview(self._received)
        view = self._received_view
        got = 0
        try:
            while got < nbytes:
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    break
                got += n
        except OSError as exc:
            if self._closed:
                raise TransportError(f"rank {self.rank}: header line from rank {self.peer} closed") from None
            raise self._dead(exc) from exc
        if got < nbytes:
            raise self._dead(None, "mid-header" if got else "without an end of stream")
        return bytes(self._received)  # a copy: the caller keeps it while the buffer takes the next header

    def read_available(self, limit: int = 1 << 16) -> bytes:
        """Whatever bytes have arrived (b"" if none yet); never blocks. TransportError when the
        connection has ended -- the peer process is gone (or closed without an end of stream)."""
        try:
            data = self._sock.recv(limit, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""
        except OSError as exc:
            raise self._dead(exc) from exc
        if not data:
            raise self._dead(None, "without an end of stream")
        return data

    def _dead(self, exc: OSError | None, closed: str = "") -> TransportError:
        """The "peer is probably dead" error of a read: the socket failed (``exc``), or the peer
        closed the line (``closed`` says where: "mid-header" or "without an end of stream")."""
        if exc is not None:
            return TransportError(
                f"rank {self.rank}: receiving from rank {self.peer} ({self.direction} channel) failed, "
                f"peer rank {self.peer} is probably dead: {exc}"
            )
        return TransportError(
            f"rank {self.rank}: rank {self.peer} closed its {self.direction} channel's header line "
            f"{closed}: peer rank {self.peer} is probably dead"
        )

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer closed first
        self._sock.close()


def advertised_address() -> str:
    """The address other ranks connect to (see the module docstring)."""
    explicit = os.environ.get("MDPP_HEADER_ADDR")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:  # MASTER_ADDR may be a name or an address of either family
            family, _, _, _, sockaddr = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)  # no packet is sent: this only picks the route
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def listen_any() -> socket.socket:
    """A listener on an ephemeral port of every interface: dual-stack (IPv6 and IPv4) where the
    kernel supports it, else IPv4 only."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        except OSError:  # IPv6 disabled on this host (e.g. ipv6.disable=1): fall back
            pass
    return socket.create_server(("0.0.0.0", 0), family=socket.AF_INET, backlog=64)


def connect_header_lines(
    edges: list[tuple[int, int, Direction]], rank: int, world_size: int, timeout_s: float
) -> dict[EdgeKey, HeaderLine]:
    """COLLECTIVE over every rank, with the same ``edges`` on each. Returns this rank's lines."""
    if not edges:
        return {}
    incoming = {(src, dst, d) for src, dst, d in edges if dst == rank}
    outgoing = [(src, dst, d) for src, dst, d in edges if src == rank]
    listener = None
    address = None
    if incoming:
        listener = listen_any()
        address = (advertised_address(), listener.getsockname()[1])
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        addresses: list = [None] * world_size
        dist.all_gather_object(addresses, address, group=group)
        deadline = time.monotonic() + timeout_s
        lines = {key: _connect(key, rank, addresses[key[1]], deadline, timeout_s) for key in outgoing}
        if listener is not None:
            lines.update(_accept(listener, incoming, rank, deadline, timeout_s))
        return lines
    finally:
        if listener is not None:
            listener.close()


def _host_port(address) -> str:  # noqa: ANN001
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _connect(key: EdgeKey, rank: int, address, deadline: float, timeout_s: float) -> HeaderLine:  # noqa: ANN001
    src, dst, direction = key
    if address is None:
        raise TransportError(f"rank {rank}: rank {dst} has no header listener for edge {src}->{dst} ({direction})")
    pause = 0.01
    while True:
        try:
            sock = socket.create_connection(tuple(address[:2]), timeout=max(deadline - time.monotonic(), 0.01))
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"rank {rank}: could not connect the header line of edge {src}->{dst} ({direction}) to "
                    f"rank {dst} at {_host_port(address)} within {timeout_s:.1f}s: {exc}"
                ) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
    _tune(sock)
    sock.sendall(_HELLO.pack(_HELLO_MAGIC, src, dst, _DIRECTIONS.index(direction)))
    return HeaderLine(sock, rank, dst, direction)


_HELLO_WAIT_S = 2.0  # a connecting rank sends its hello at once; a silent connection is not one of ours


def _accept(
    listener: socket.socket, expected: set[EdgeKey], rank: int, deadline: float, timeout_s: float
) -> dict[EdgeKey, HeaderLine]:
    """Accept until every ``expected`` edge has its line. A connection that is not one of them (no
    hello, a wrong one, a second one for an edge) is closed and logged, not fatal: the listener
    accepts on every interface, and a stray connection must not end the job."""
    lines: dict[EdgeKey, HeaderLine] = {}
    while len(lines) < len(expected):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = ", ".join(f"{s}->{d} ({w})" for s, d, w in sorted(expected - set(lines)))
            raise TransportTimeout(
                f"rank {rank}: header lines of edge(s) {missing} not connected within {timeout_s:.1f}s: "
                f"those ranks never connected"
            )
        listener.settimeout(remaining)
        try:
            sock, peer_address = listener.accept()
        except TimeoutError:
            continue  # the deadline check above names what is missing
        key = None
        try:
            sock.settimeout(min(remaining, _HELLO_WAIT_S))
            raw = b""
            while len(raw) < _HELLO.size:
                chunk = sock.recv(_HELLO.size - len(raw))
                if not chunk:
                    raise ConnectionError("closed before its hello")
                raw += chunk
            magic, src, dst, code = _HELLO.unpack(raw)
            if magic == _HELLO_MAGIC and 0 <= code < len(_DIRECTIONS):
                key = (src, dst, _DIRECTIONS[code])
            what = f"hello (magic {magic:#x}, edge {src}->{dst}, direction code {code})"
        except OSError as exc:  # timeouts and resets included
            what = f"no hello ({exc})"
        if key not in expected or key in lines:
            sock.close()
            log.warning("rank %d: ignored a header line connection from %s:%s: %s", rank, *peer_address[:2], what)
            continue
        _tune(sock)
        lines[key] = HeaderLine(sock, rank, key[0], key[2])
    return lines
