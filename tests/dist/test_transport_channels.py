"""What every CPU transport must do (order, credits, close, a dead peer named, bounded waits), each on real processes.

Each test spawns its ranks through ``trainer.launch.local_ranks.run_processes`` (a forkserver with torch preloaded,
gloo rendezvous on a free port) and is parametrised over the transports: "gloo" (a process group per
directed edge) and "shm" (the C++ shared-memory ring). conftest.py fails any test that leaves
a segment of its own (/dev/shm/mdpp-<tag>*) behind, so no scenario here leaks one either.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.shm_tag import tagged
from trainer.launch.local_ranks import check_all_ok, run_processes
from trainer.launch.topology import Topology
from trainer.transport import TransportError, TransportTimeout
from trainer.transport.factory import LinkOptions, make_stage_links
from trainer.transport.tensors import header_for

TRANSPORTS = ["gloo", "shm"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8, torch.float64]
SIZES = [0, 1, 3, 17, 1000, 4096, 65537, 300_000]  # elements: empty, odd, around slot and page sizes


def payload(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic, seed-dependent content, so a reordered or corrupt message is detected."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=gen) * 100).to(dtype)
    return torch.randint(0, 120, (numel,), generator=gen).to(dtype)


def _links(rank: int, world: int, transport: str, **options) -> object:
    topo = Topology(world_size=world, rank=rank, pipeline_parallel=world)
    # Small slots: CI containers may have a small /dev/shm (Docker's default is 64 MiB).
    options = {"shm_slot_bytes": 1 << 20, **options}
    return make_stage_links(topo, transport, "cpu", timeout_s=20.0, options=LinkOptions(**options))


def _receive(links, count: int, timeout: float = 20.0) -> list:
    """``count`` messages as (header, clone of tensor, source), releasing each slot."""
    got = []
    for _ in range(count):
        msg = links.wait_any(timeout)
        got.append((msg.header, msg.tensor.clone(), msg.source_rank))
        links.release(msg)
    return got


def _cases():
    return [(i, n, d) for i, (n, d) in enumerate((n, d) for n in SIZES for d in DTYPES)]


# ---- ordering and integrity, many sizes and dtypes, both directions at once -------------------------
def _ordering_scenario(rank: int, world: int, transport: str) -> int:
    links = _links(rank, world, transport, shm_slot_bytes=256 << 10)
    cases = _cases()
    direction, kind = ("next", "act") if rank == 0 else ("prev", "grad")

    def send_all():
        for i, numel, dtype in cases:
            t = payload(1000 * rank + i, numel, dtype).reshape(-1, 1) if numel % 2 else payload(1000 * rank + i, numel, dtype).reshape(2, -1) if numel else payload(0, 0, dtype)
            links.send(direction, t, header_for(t, kind, microbatch=i, chunk=rank))

    sender = threading.Thread(target=send_all)
    sender.start()
    got = _receive(links, len(cases))
    sender.join(30)
    peer = 1 - rank
    for (header, tensor, source), (i, numel, dtype) in zip(got, cases, strict=True):
        assert source == peer and header.microbatch == i and header.chunk == peer, (header, i)
        assert header.kind == ("grad" if rank == 0 else "act")
        expected = payload(1000 * peer + i, numel, dtype)
        assert tensor.dtype == dtype and tensor.numel() == numel, (header, tensor.shape)
        assert torch.equal(tensor.reshape(-1), expected), f"message {i} ({numel} x {dtype}) corrupted"
    links.close()
    return len(got)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ordering_and_integrity_across_processes(transport):
    counts = check_all_ok(run_processes(_ordering_scenario, 2, transport))
    assert counts == [len(_cases())] * 2


# ---- a 3-stage ring: wrap-around edges, both channels per rank, more messages than slots ------------
def _ring_scenario(rank: int, world: int, transport: str) -> dict:
    links = _links(rank, world, transport, credits=2)
    rounds = 7  # > credits: every slot is reused several times
    for m in range(rounds):
        links.send("next", torch.full((5, 3), float(100 * rank + m)), header_for(torch.empty(5, 3), "act", m, 0))
        links.send("prev", torch.full((4,), float(-100 * rank - m)), header_for(torch.empty(4), "grad", m, 0))
        # Consume as we go so credits come back (each peer sends us one per direction per round).
        for msg in (links.wait_any(20), links.wait_any(20)):
            links.release(msg)
    links.close()
    return {"rank": rank}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_three_stage_ring_with_wraparound_edges(transport):
    check_all_ok(run_processes(_ring_scenario, 3, transport))


def _ring_content_scenario(rank: int, world: int, transport: str) -> list:
    links = _links(rank, world, transport, credits=2)
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    seen = []

    def sender():
        for m in range(6):
            links.send("next", torch.full((8,), float(100 * rank + m)), header_for(torch.empty(8), "act", m, 0))
            links.send("prev", torch.full((8,), float(-100 * rank - m)), header_for(torch.empty(8), "grad", m, 0))

    thread = threading.Thread(target=sender)
    thread.start()
    for header, tensor, source in _receive(links, 12):
        sign = 1 if header.kind == "act" else -1
        assert source == (prev if header.kind == "act" else nxt), (rank, header, source)
        assert torch.equal(tensor, torch.full((8,), float(sign * (100 * source + header.microbatch))))
        seen.append((header.kind, source, header.microbatch))
    thread.join(30)
    links.close()
    return seen


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ring_delivers_each_edge_in_order(transport):
    for rank, seen in enumerate(check_all_ok(run_processes(_ring_content_scenario, 3, transport))):
        for kind, source in (("act", (rank - 1) % 3), ("grad", (rank + 1) % 3)):
            assert [m for k, s, m in seen if (k, s) == (kind, source)] == list(range(6))


# ---- credit exhaustion: the sender waits, nothing is lost --------------------------------------------
def _credit_scenario(rank: int, world: int, transport: str) -> list:
    credits, count, pause = 2, 9, 1.0
    links = _links(rank, world, transport, credits=credits)
    if rank == 0:
        send_returned = []
        start = time.monotonic()
        for m in range(count):
            t = torch.full((64 << 10,), float(m))  # 256 KiB: too big for socket buffers to absorb
            links.send("next", t, header_for(t, "act", m, 0))
            send_returned.append(time.monotonic() - start)
        links.close()
        return send_returned
    time.sleep(pause)  # receiver busy: the sender must run out of credits and wait
    got = _receive(links, count)
    assert [h.microbatch for h, _, _ in got] == list(range(count))
    assert all(torch.equal(t, torch.full((64 << 10,), float(h.microbatch))) for h, t, _ in got)
    links.close()
    return []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_credit_exhaustion_sender_waits_nothing_lost(transport):
    send_returned, _ = check_all_ok(run_processes(_credit_scenario, 2, transport))
    assert send_returned[-1] >= 0.8, f"all sends returned before the receiver consumed: {send_returned}"
    if transport == "shm":  # exact slot accounting: the first `credits` sends never wait
        assert send_returned[1] < 0.5 and send_returned[2] >= 0.8, send_returned


def _close_while_blocked_scenario(rank: int, world: int, transport: str) -> float:
    """Both ranks stream more than their credits and never consume, then close."""
    links = _links(rank, world, transport, credits=2)
    t = torch.ones(64 << 10)  # 256 KiB

    def flood():
        try:
            for m in range(8):
                links.send("next", t, header_for(t, "act", m, 0))
        except TransportError:
            pass  # the peer closed its end while we were blocked on its credits: expected

    thread = threading.Thread(target=flood)
    thread.start()
    time.sleep(1.0)  # both senders are now blocked on credits held by undelivered messages
    start = time.monotonic()
    links.close()
    thread.join(20)
    assert not thread.is_alive()
    return time.monotonic() - start


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_with_undelivered_messages_and_blocked_senders(transport):
    for elapsed in check_all_ok(run_processes(_close_while_blocked_scenario, 2, transport)):
        assert elapsed < 5.0, f"close took {elapsed:.1f}s (timeout is 20s): it waited on a blocked peer"


# ---- payload larger than a slot, non-contiguous input --------------------------------------------------
def _big_and_strided_scenario(rank: int, world: int, transport: str) -> bool:
    links = _links(rank, world, transport, shm_slot_bytes=64 << 10, credits=2)
    big = payload(7, 1_000_003, torch.bfloat16)  # ~2 MB: 31 slots of 64 KiB
    base = payload(8, 64 * 48, torch.float32).reshape(64, 48)
    strided = [base.t(), base[::3, 5:40], base.reshape(8, 8, 48).permute(2, 0, 1)[:, 1]]
    if rank == 0:
        for m, t in enumerate([big, *strided]):
            assert m == 0 or not t.is_contiguous()
            links.send("next", t, header_for(t, "act", m, 0))
    else:
        got = _receive(links, 4)
        for (header, tensor, _), expected in zip(got, [big, *strided], strict=True):
            assert tensor.shape == expected.shape and torch.equal(tensor, expected), header
    links.close()
    return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_payload_larger_than_slot_and_non_contiguous_input(transport):
    assert check_all_ok(run_processes(_big_and_strided_scenario, 2, transport)) == [True, True]


# ---- a peer killed mid-transfer: the survivor errors within its timeout, naming the peer ---------------
def _killed_peer_scenario(rank: int, world: int, transport: str, victim: str) -> tuple[str, float]:
    """Rank 1 dies (SIGKILL) while a stream of 4 MiB messages flows between the two ranks.

    victim="sender": rank 1 streams to rank 0 and is killed mid-message; rank 0 keeps receiving.
    victim="receiver": rank 0 streams to rank 1, which stops releasing slots and is killed; rank 0
    is then blocked on credits (shm) or on an unfinished send (gloo).
    """
    topo = Topology(world_size=world, rank=rank, pipeline_parallel=world)
    options = LinkOptions(shm_slot_bytes=64 << 10, credits=2)
    links = make_stage_links(topo, transport, "cpu", timeout_s=KILL_TIMEOUT_S, options=options)
    big = torch.ones(4 << 20, dtype=torch.uint8)  # 64 slots of 64 KiB: the kill lands mid-message
    if rank == 1:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            if victim == "sender":
                links.send("prev", big, header_for(big, "grad", 0, 0))
            else:
                links.wait_any(15.0)  # take messages but never release them
    time.sleep(0.2)
    start = time.monotonic()
    try:
        while True:  # keep the traffic going: the error must surface mid-stream
            if victim == "sender":
                links.release(links.wait_any(15.0))
            else:
                links.send("next", big, header_for(big, "act", 0, 0))
    except TransportError as exc:
        elapsed = time.monotonic() - start
        links.close()
        return type(exc).__name__, str(exc), elapsed


KILL_TIMEOUT_S = 6.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", ["sender", "receiver"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_killed_mid_transfer_is_reported_naming_it(transport, victim):
    survivor, killed = run_processes(_killed_peer_scenario, 2, transport, victim)
    assert killed.exitcode == -signal.SIGKILL, killed
    kind, message, elapsed = check_all_ok([survivor])[0]
    assert "rank 1" in message, message
    if transport == "shm" or victim == "sender":
        # The ring checks the peer's pid; a gloo receive fails as soon as the socket closes.
        assert kind == "TransportError" and elapsed < KILL_TIMEOUT_S, (kind, message, elapsed)
    else:
        # A gloo send to a dead receiver fails when TCP notices, which it sometimes does not:
        # then the send's timeout is what names the peer. Either way: within the timeout.
        assert elapsed < KILL_TIMEOUT_S + 2.0, (kind, message, elapsed)


def _silent_peer_scenario(rank: int, world: int, transport: str) -> tuple[str, float]:
    links = _links(rank, world, transport)
    message, cpu_seconds = "", 0.0
    if rank == 0:
        cpu_before = time.process_time()  # all threads of this process: receivers included
        with pytest.raises(TransportTimeout) as info:
            links.wait_any(1.5)
        cpu_seconds = time.process_time() - cpu_before
        message = str(info.value)
    links.close()
    return message, cpu_seconds


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_idle_wait_times_out_naming_rank_and_peers_without_spinning(transport):
    (message, cpu_seconds), _ = check_all_ok(run_processes(_silent_peer_scenario, 2, transport))
    assert "rank 0" in message and "[1]" in message, message
    # A spinning wait would burn ~1.5 CPU-seconds per spinning thread; the futex/condition waits
    # (and the dead-peer checks every 50 ms) cost a few milliseconds.
    assert cpu_seconds < 0.3, f"waiting 1.5 s used {cpu_seconds:.2f} s of CPU"


# ---- auto: shm inside a "node", gloo across, chosen from the launcher's node index --------------------
def _auto_scenario(rank: int, world: int, job: str) -> tuple[str, list]:
    # Four stages on two nodes of one host: edges 0-1 and 2-3 stay on a node, 1-2 and 3-0 cross.
    topo = Topology(world_size=world, rank=rank, pipeline_parallel=world, node_of_rank=(0, 0, 1, 1))
    links = make_stage_links(topo, "auto", "cpu", timeout_s=20.0, job_id=job, options=LinkOptions(shm_slot_bytes=1 << 20))
    # Every ring is unlinked as soon as both ends mapped it: none is visible while links are open.
    visible = [n for n in os.listdir("/dev/shm") if n.startswith(f"mdpp-{job}")]
    links.send("next", torch.full((3,), float(rank)), header_for(torch.empty(3), "act", rank, 0))
    links.send("prev", torch.full((2,), -float(rank)), header_for(torch.empty(2), "grad", rank, 0))
    got = sorted((h.kind, src, t.tolist()) for h, t, src in _receive(links, 2))
    links.close()
    return links.description, [visible, got]


@pytest.mark.timeout(90)
def test_auto_uses_shm_within_a_node_and_gloo_across():
    job = tagged("auto")
    for rank, (description, (visible, got)) in enumerate(check_all_ok(run_processes(_auto_scenario, 4, job))):
        prev, nxt = (rank - 1) % 4, (rank + 1) % 4
        assert visible == [], f"rank {rank} sees shared-memory names: {visible}"
        assert got == sorted([("act", prev, [float(prev)] * 3), ("grad", nxt, [-float(nxt)] * 2)])
        same_node_peer = rank ^ 1  # 0<->1, 2<->3
        for direction, peer in (("next", nxt), ("prev", prev)):
            expected = "shm" if peer == same_node_peer else "gloo"
            assert f"{direction}:{rank}->{peer}:{expected}" in description, description


# ---- set-up failure on one rank: every rank raises, nothing is left behind ------------------------------
def _stale_paths(job: str) -> tuple[Path, Path]:
    return (Path(f"/dev/shm/mdpp-{job}-1-0-next"),  # what rank 0 would create for its incoming ring
            Path(f"/dev/shm/mdpp-{job}-1-1-0-next"))  # ring 1->0 of the run "<job>-1": not ours


def _stale_name_scenario(rank: int, world: int, job: str) -> tuple[str, list[bool]]:
    topo = Topology(world_size=world, rank=rank, pipeline_parallel=world)
    stale, other = _stale_paths(job)
    if rank == 0:  # planted just before the set-up: on a shared host a file left long in /dev/shm may
        stale.touch()  # be removed by something else (a leak check that looks at the whole of it)
        other.touch()
    with pytest.raises(TransportError) as info:
        make_stage_links(topo, "shm", "cpu", timeout_s=20.0, job_id=job, options=LinkOptions(shm_slot_bytes=4096))
    return str(info.value), [stale.exists(), other.exists()]


@pytest.mark.timeout(60)
def test_setup_failure_on_one_rank_fails_every_rank_cleanly():
    job = tagged("stale")
    try:
        outcomes = check_all_ok(run_processes(_stale_name_scenario, 2, job))
    finally:
        for path in _stale_paths(job):
            path.unlink(missing_ok=True)
    # The failed set-up removed every segment of its run, the one in its way included, and nothing
    # of the other run.
    assert outcomes[0][1] == [False, True], outcomes[0]
    for message, _ in outcomes:
        assert "set-up (create) failed" in message and "rank 0" in message and "File exists" in message, message
