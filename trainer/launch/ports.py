"""A free loopback port for a local rendezvous: the launcher's (trainer/launch/local_ranks.py), and that of
the tests that start a process group themselves. Torch-free."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
