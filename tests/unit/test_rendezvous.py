"""The rendezvous gives up within its deadline and says which rank waited for what
(trainer/launch/rendezvous.py). Real TCP stores on loopback; the "ranks" are threads of this process,
or absent, which is the point."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from trainer.launch.ports import free_port
from trainer.launch.rendezvous import (
    RENDEZVOUS_TIMEOUT_ENV,
    RENDEZVOUS_TIMEOUT_S,
    RendezvousError,
    rendezvous,
    rendezvous_timeout,
)

TIMEOUT_S = 2.0
BOUND_S = 15.0  # the deadline, plus a loaded 2-core machine's scheduling


def test_a_rank_whose_rank_0_never_listens_gives_up_naming_itself_and_the_address():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        rendezvous(2, 4, "127.0.0.1", port, TIMEOUT_S)
    assert TIMEOUT_S <= time.monotonic() - started < BOUND_S
    assert f"rank 2 waited {TIMEOUT_S:g} s for rank 0's rendezvous store at 127.0.0.1:{port}" in str(caught.value)
    assert RENDEZVOUS_TIMEOUT_ENV in str(caught.value)


def test_rank_0_names_the_ranks_that_never_arrived():
    port = free_port()
    joined: list[object] = []
    # Rank 1 arrives; ranks 2 and 3 never start.
    helper = threading.Thread(target=lambda: joined.append(_attempt(1, 4, port)), daemon=True)
    helper.start()
    started = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        rendezvous(0, 4, "127.0.0.1", port, TIMEOUT_S + 1)
    assert time.monotonic() - started < BOUND_S
    assert "rank 0 waited 3 s at the rendezvous" in str(caught.value), caught.value
    assert "for rank(s) 2, 3 of 4, which never arrived (arrived: 0, 1)" in str(caught.value), caught.value
    helper.join(BOUND_S)
    assert len(joined) == 1 and isinstance(joined[0], RendezvousError), joined


@contextlib.contextmanager
def _foreign_listener() -> Iterator[int]:
    """A plain socket (not a store) listening on a loopback port: its port."""
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        yield foreign.getsockname()[1]


def test_rank_0_that_cannot_listen_fails_at_once():
    with _foreign_listener() as port:
        started = time.monotonic()
        with pytest.raises(RendezvousError) as caught:
            rendezvous(0, 2, "127.0.0.1", port, 60.0)
    assert time.monotonic() - started < BOUND_S
    assert f"rank 0 could not listen at 127.0.0.1:{port}" in str(caught.value), caught.value


def test_every_rank_meets_and_gets_a_store():
    port = free_port()
    results: dict[int, object] = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, _attempt(r, 3, port, 30.0)), daemon=True)
               for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND_S + 30)
    assert sorted(results) == [0, 1, 2] and not any(isinstance(v, BaseException) for v in results.values()), results


def test_the_deadline_comes_from_the_environment_or_the_default():
    assert rendezvous_timeout({}) == RENDEZVOUS_TIMEOUT_S
    assert rendezvous_timeout({RENDEZVOUS_TIMEOUT_ENV: "12.5"}) == 12.5
    for bad in ("0", "-3", "soon"):
        with pytest.raises(RendezvousError, match=RENDEZVOUS_TIMEOUT_ENV):
            rendezvous_timeout({RENDEZVOUS_TIMEOUT_ENV: bad})


def _attempt(rank: int, world: int, port: int, timeout_s: float = TIMEOUT_S) -> object:
    try:
        return rendezvous(rank, world, "127.0.0.1", port, timeout_s)
    except BaseException as err:  # returned to the test's thread
        return err


def test_a_rank_that_finds_something_else_listening_at_the_address_gives_up_within_its_deadline(monkeypatch):
    # torch's own store client waits for an answer without a bound: here nothing ever answers.
    monkeypatch.setattr("trainer.launch.rendezvous.CONNECT_S", TIMEOUT_S)  # the least it allows to connect
    with _foreign_listener() as port:
        started = time.monotonic()
        with pytest.raises(RendezvousError) as caught:
            rendezvous(1, 2, "127.0.0.1", port, TIMEOUT_S)
    assert time.monotonic() - started < BOUND_S
    assert f"rank 1 connected to 127.0.0.1:{port}" in str(caught.value), caught.value
    assert "no rendezvous store answered" in str(caught.value), caught.value


def test_a_process_that_trains_again_meets_its_peers_again_at_the_same_port():
    # A run's store server can outlive it in the process (a group of that run still holds it): the next
    # run's rank 0 shares it rather than failing to bind, and waits for the new run's check-ins, not
    # the old ones.
    port = free_port()
    first = rendezvous(0, 1, "127.0.0.1", port, TIMEOUT_S)
    again = rendezvous(0, 1, "127.0.0.1", port, TIMEOUT_S)
    assert again.check(["mdpp/rendezvous/arrived/2/0"]) and first is not again
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"for rank\(s\) 1 of 2, which never arrived"):
        rendezvous(0, 2, "127.0.0.1", port, TIMEOUT_S)  # rank 1 checked in with no earlier run here
    assert time.monotonic() - started < BOUND_S
