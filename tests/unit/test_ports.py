"""A local rendezvous port comes from below the kernel's ephemeral range, where no other run's outgoing
connection can take it between the launcher's pick and rank 0's listen."""

from __future__ import annotations

import socket

from trainer.launch import ports


def test_a_rendezvous_port_is_free_and_below_the_ephemeral_range() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    for _ in range(20):
        port = ports.free_port()
        assert port in ports.RENDEZVOUS_PORTS and port < ephemeral_low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out


def test_a_listening_port_is_never_handed_out_and_the_kernel_picks_when_none_is_free(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "RENDEZVOUS_PORTS", range(busy, busy + 1))
        monkeypatch.setattr(ports.random.Random, "sample", lambda self, population, k: [busy] * k)
        port = ports.free_port()  # every draw is the listening port: the kernel's pick instead
        assert port != busy and 0 < port < 65536
