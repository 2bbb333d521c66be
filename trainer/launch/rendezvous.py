"""The rendezvous: every rank of the run meets at rank 0's TCP store before the process group is built,
under a deadline of its own that names who waited for what.

torch's ``init_process_group(init_method="tcp://...")`` waits for rank 0's store, and then for every
rank, as long as the collective timeout (max(600 s, --dpp-timeout) here), and its errors say neither
which rank waited nor for whom: when rank 0 died before it listened (its store could not bind), its
peers sat there ten minutes and then reported a socket timeout. Here:

- rank 0 listens at MASTER_ADDR:MASTER_PORT, or fails at once saying it could not;
- every other rank waits for rank 0's store to answer, at most the rendezvous timeout;
- then every rank checks in and waits until all ``world_size`` have, within the same deadline
  (counted from when this rank began the rendezvous), naming the ranks that never arrived;
- a rank that loses rank 0's store while waiting (rank 0 died after listening) fails at once.

Only then is the process group built on that store, with the collective timeout. The deadline is
RENDEZVOUS_TIMEOUT_S unless $MDPP_RENDEZVOUS_TIMEOUT sets another (seconds): ranks of one job start
within seconds of each other under srun or torchrun, but each imports megatron-core first, which on a
loaded host can take minutes. A launcher that sees one rank die ends the others sooner (srun's
--kill-on-bad-exit, torchrun, trainer/launch/local_ranks.py's failure grace); this bound is for when
nothing does.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Mapping

import torch.distributed as dist

RENDEZVOUS_TIMEOUT_S = 300.0
"""How long a rank waits at the rendezvous (for rank 0's store, then for every rank) by default."""
RENDEZVOUS_TIMEOUT_ENV = "MDPP_RENDEZVOUS_TIMEOUT"
"""Environment: the rendezvous deadline in seconds, instead of RENDEZVOUS_TIMEOUT_S."""
ARRIVED_KEY = "mdpp/rendezvous/arrived/"
"""Store key prefix: ``<prefix><generation>/<rank>`` is set once that rank has checked in (outside
torch's own ``default_pg`` prefix, so the process group built on the store never reads it)."""
_generations: dict[tuple[str, int, int], int] = {}
"""Rendezvous made by this process per address and rank: a process that trains several times (tests, notebooks)
meets its peers again at rank 0's store, whose server may outlive a run (see :func:`rendezvous`), so each
run's check-ins carry its own generation -- the same on every rank, which repeat the same runs."""
POLL_S = 0.25
CONNECT_S = 10.0
"""Seconds a rank allows for connecting to a store that listens already (a moment, on any network)."""


class RendezvousError(RuntimeError):
    """A rank gave up at the rendezvous (the message names the rank, what it waited for and where)."""


def rendezvous_timeout(env: Mapping[str, str] | None = None) -> float:
    """The rendezvous deadline in seconds: $MDPP_RENDEZVOUS_TIMEOUT, else RENDEZVOUS_TIMEOUT_S."""
    env = os.environ if env is None else env
    text = env.get(RENDEZVOUS_TIMEOUT_ENV, "")
    if not text:
        return RENDEZVOUS_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RendezvousError(f"{RENDEZVOUS_TIMEOUT_ENV}={text!r} must be a number of seconds > 0")
    return value


def rendezvous(rank: int, world_size: int, host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """Meet every rank at rank 0's store on ``host:port`` within ``timeout_s``; the store, for
    ``init_process_group(store=...)``. RendezvousError (naming this rank and what it waited for) past
    the deadline, or at once when rank 0 cannot listen or its store goes away."""
    where = f"{host}:{port} (MASTER_ADDR:MASTER_PORT)"
    started = time.monotonic()
    deadline = started + timeout_s
    if rank == 0:
        try:
            # multi_tenant, as torch's own tcp:// rendezvous: a server this process still holds on the port
            # (a group of an earlier run in the same process keeps it alive) is shared, not a bind error.
            store = dist.TCPStore(host, port, world_size, is_master=True, multi_tenant=True,
                                  timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        except (RuntimeError, OSError) as err:
            raise RendezvousError(f"rank 0 could not listen at {where} for the rendezvous: {_first_line(err)} "
                                  "(another process holds the port?); its peers will wait for it in vain") from None
    else:
        _wait_until_listening(rank, host, port, where, deadline, timeout_s)
        store = _connect(rank, host, port, world_size, where, max(deadline - time.monotonic(), CONNECT_S))
    try:
        _generations[(host, port, rank)] = generation = _generations.get((host, port, rank), 0) + 1
        arrived = f"{ARRIVED_KEY}{generation}/"
        store.set(f"{arrived}{rank}", "1")
        _wait_for_everyone(store, arrived, rank, world_size, where, deadline, timeout_s)
    except (RuntimeError, OSError) as err:
        if isinstance(err, RendezvousError):
            raise
        raise RendezvousError(f"rank {rank} lost rank 0's rendezvous store at {where} after "
                              f"{time.monotonic() - started:.0f} s, while waiting for every rank to arrive: "
                              f"{_first_line(err)} (rank 0 has exited: its log says why)") from None
    return store


def _connect(rank: int, host: str, port: int, world_size: int, where: str, timeout_s: float) -> dist.TCPStore:
    """A client of the store listening at ``host:port``, within ``timeout_s``. torch's client waits
    for the store's answer without a bound: should something other than a store listen there, it
    would wait forever, so it runs in a thread this rank stops waiting for (the rank then fails and
    exits; the thread goes with it)."""
    outcome: list[object] = []

    def connect() -> None:
        try:
            outcome.append(dist.TCPStore(host, port, world_size, is_master=False,
                                         timeout=datetime.timedelta(seconds=timeout_s)))
        except BaseException as err:  # handed to the waiting thread
            outcome.append(err)

    thread = threading.Thread(target=connect, name=f"rendezvous-connect-rank{rank}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise RendezvousError(f"rank {rank} connected to {where}, but no rendezvous store answered there within "
                              f"{timeout_s:.0f} s: is another program listening at MASTER_PORT?")
    if isinstance(outcome[0], BaseException):
        raise RendezvousError(f"rank {rank} could not connect to rank 0's rendezvous store at {where}: "
                              f"{_first_line(outcome[0])}") from None
    return outcome[0]  # type: ignore[return-value]


def _wait_until_listening(rank: int, host: str, port: int, where: str, deadline: float, timeout_s: float) -> None:
    """Poll rank 0's address with plain connects until something listens there (quietly: torch's own
    client prints a stack trace per failed attempt)."""
    last = ""
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as err:
            last = str(err)
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"rank {rank} waited {timeout_s:g} s for rank 0's rendezvous store at {where}, which never "
                f"listened ({last}): rank 0 did not start, failed before listening (its log says why), or "
                f"listens elsewhere. ${RENDEZVOUS_TIMEOUT_ENV} sets this wait")
        time.sleep(POLL_S)


def _wait_for_everyone(store: dist.TCPStore, arrived: str, rank: int, world_size: int, where: str,
                       deadline: float, timeout_s: float) -> None:
    missing = list(range(world_size))
    while True:
        missing = [r for r in missing if not store.check([f"{arrived}{r}"])]
        if not missing:
            return
        if time.monotonic() >= deadline:
            arrived = sorted(set(range(world_size)) - set(missing))
            raise RendezvousError(
                f"rank {rank} waited {timeout_s:g} s at the rendezvous ({where}) for rank(s) "
                f"{_ranks(missing)} of {world_size}, which never arrived (arrived: {_ranks(arrived)}): they did "
                f"not start or failed before the rendezvous (their logs say why). ${RENDEZVOUS_TIMEOUT_ENV} "
                "sets this wait")
        time.sleep(POLL_S)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 16 else f"{', '.join(map(str, ranks[:16]))}, ... ({len(ranks)})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
