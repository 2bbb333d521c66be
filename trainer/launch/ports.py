"""A free loopback port for a local rendezvous: the launcher's (trainer/launch/local_ranks.py), and that of
the tests that start a process group themselves. Torch-free."""

from __future__ import annotations

import random
import socket

RENDEZVOUS_PORTS = range(30000, 32768)
"""Where a local rendezvous port is drawn from: below Linux's ephemeral range (32768-60999), where the
kernel hands out ports to every process's outgoing connections and ``bind(0)`` -- a port picked there
and free now could be taken by any gloo connection of another run before rank 0 listens on it (two
concurrent test runs on one host met exactly that: EADDRINUSE at rank 0's store). Above Slurm jobs'
MASTER_PORT (workflows/nodes.py: 20000 + job id mod 10000) and the local clusters' daemon ports, which
the bind check below skips anyway while they listen."""


def bindable(host: str, port: int) -> bool:
    """Whether a TCP socket can bind ``host:port`` now (nothing listens or holds it there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, drawn at random from RENDEZVOUS_PORTS (the
    kernel's own pick for port 0 if none of 64 draws is free)."""
    for port in random.Random().sample(RENDEZVOUS_PORTS, 64):
        if bindable("127.0.0.1", port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
