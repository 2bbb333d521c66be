"""The gloo/NCCL channel protocol on CPU (gloo payloads run the same code as NCCL ones).

Header protocol (the header travels on the host channel, the payload receive is posted only after
it), timeouts that name the peer and what was awaited, randomized send orders across edges (many
seeds, PP=4 ring, also mixed with shared-memory edges in a 2+2 "node" split), and no /dev/shm left
after close or after a killed peer (tests/conftest.py fails any test that leaves mdpp* behind).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from tests.shm_tag import tagged
from trainer.launch.local_ranks import check_all_ok, run_processes
from trainer.launch.topology import Topology
from trainer.transport import TransportError, TransportTimeout
from trainer.transport.edge_groups import build_edge_groups
from trainer.transport.factory import LinkOptions, make_stage_links, plan_channels
from trainer.transport.tensors import header_for
from trainer.transport.wire import encode, pack

TIMEOUT_S = 3.0


def _links(rank: int, world: int, transport: str = "gloo", nodes: tuple[int, ...] = (), credits: int = 2,
           timeout_s: float = TIMEOUT_S, job: str | None = None):  # fmt: skip
    topo = Topology(world_size=world, rank=rank, pipeline_parallel=world, node_of_rank=nodes)
    options = LinkOptions(credits=credits, shm_slot_bytes=1 << 20)
    return make_stage_links(topo, transport, "cpu", timeout_s=timeout_s, job_id=job, options=options)


# ---- header protocol ----------------------------------------------------------------------------------
def _raw_header_scenario(rank: int, world: int, case: str) -> str:
    """Rank 0 writes header words straight onto the edge's header line, as a broken peer would."""
    topo = Topology(world_size=world, rank=rank, pipeline_parallel=world)
    if rank == 0:
        plan = plan_channels(topo, "gloo", torch.device("cpu"))
        edges = build_edge_groups([(s.src, s.dst, s.direction, s.transport) for s in plan], 0, torch.device("cpu"), 5)
        header = header_for(torch.empty(1000), "act", 7, 0)
        words = encode(header, sequence=5 if case == "sequence" else 0)
        edges[(0, 1, "next")].header.send(pack(words), 5.0)
        time.sleep(TIMEOUT_S + 2)  # alive, but never sends the payload
        return ""
    links = _links(rank, world)
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        links.wait_any(10.0)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + 1.5, elapsed
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.timeout(60)
def test_out_of_sequence_header_is_refused_naming_the_peer():
    message = check_all_ok(run_processes(_raw_header_scenario, 2, "sequence", timeout_s=40))[1]
    assert "rank 1: message 5 from rank 0 arrived when 0 was due" in message, message


@pytest.mark.timeout(60)
def test_header_without_payload_times_out_naming_peer_and_message():
    message = check_all_ok(run_processes(_raw_header_scenario, 2, "no-payload", timeout_s=40))[1]
    assert message.startswith("TransportTimeout"), message
    assert "rank 1: the payload of message 0 (4000 bytes) from rank 0 (next channel)" in message, message


def _posted_ahead_scenario(rank: int, world: int) -> list[int]:
    """The receiver never consumes: it must post at most `credits` payload receives ahead."""
    links = _links(rank, world, credits=2, timeout_s=20.0)
    if rank == 0:
        returned = []
        start = time.monotonic()
        for m in range(5):
            t = torch.full((64 << 10,), float(m))
            links.send("next", t, header_for(t, "act", m, 0))
            returned.append(round(time.monotonic() - start, 2))
        links.close()
        return returned
    time.sleep(1.0)
    receiver = next(r for r in links._receivers if r.direction == "next")
    receiver._progress.pump()  # what any wait of this rank does
    posted = len(receiver._posted)
    announced = len(receiver._announced)
    got = [links.wait_any(10).header.microbatch for _ in range(5)]
    links.close()
    return [posted, announced, *got]


@pytest.mark.timeout(60)
def test_payload_receives_posted_ahead_are_bounded_by_credits():
    sends, (posted, announced, *got) = check_all_ok(run_processes(_posted_ahead_scenario, 2, timeout_s=50))
    assert got == list(range(5))
    assert posted == 2, (posted, announced)  # credits=2: never more payload receives ahead
    assert sends[-1] >= 0.8, sends  # so the sender ran out of in-flight sends and waited


# ---- timeouts name the peer --------------------------------------------------------------------------
def _deaf_peer_scenario(rank: int, world: int) -> tuple[str, float]:
    links = _links(rank, world, credits=1, timeout_s=2.0)
    if rank == 1:
        time.sleep(5.0)  # alive, never receives
        return "", 0.0
    t = torch.ones(64 << 10)
    start = time.monotonic()
    with pytest.raises(TransportTimeout) as info:
        for m in range(10):
            links.send("next", t, header_for(t, "act", m, 0))
    return str(info.value), time.monotonic() - start


@pytest.mark.timeout(60)
def test_send_to_a_peer_that_never_receives_times_out_naming_it():
    (message, elapsed), _ = check_all_ok(run_processes(_deaf_peer_scenario, 2, timeout_s=40))
    assert "rank 0: send of message 0 (act microbatch 0 chunk 0) to rank 1 (next channel)" in message, message
    assert "did not complete within 2.0s" in message, message
    assert elapsed < 2.0 + 1.5, elapsed


def _never_closing_scenario(rank: int, world: int) -> str:
    links = _links(rank, world, timeout_s=1.5)
    if rank == 1:
        time.sleep(7.0)  # never closes within rank 0's timeout
        return ""
    start = time.monotonic()
    links.close()  # two receivers, each gives up after 1.5 s (logged as a warning)
    assert time.monotonic() - start < 5.0
    return "closed"


@pytest.mark.timeout(60)
def test_close_is_bounded_when_the_peer_never_closes():
    assert check_all_ok(run_processes(_never_closing_scenario, 2, timeout_s=40))[0] == "closed"


# ---- randomized send orders across edges --------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]


def _round_plan(seed: int, round_: int, world: int, credits: int) -> dict:
    """Every rank's sends of one round, the same on every rank: {(src, direction): [(mb, numel, dtype)]}."""
    rng = random.Random(seed * 1000 + round_)
    plan = {}
    for src in range(world):
        for direction in ("next", "prev"):
            plan[(src, direction)] = [
                (m, rng.choice([0, 1, 7, 1000, 70_000]), rng.randrange(len(DTYPES)))
                for m in range(rng.randint(0, credits))  # <= credits: a round never needs the peer's polls
            ]
    return plan


def _content(src: int, direction: str, mb: int, numel: int, dtype_index: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((src, direction, mb, seed)) % (1 << 31))
    return (torch.randn(numel, generator=gen) * 100).to(DTYPES[dtype_index])


def _random_order_scenario(rank: int, world: int, transport: str, nodes: tuple, seeds: list[int], rounds: int,
                           job: str) -> int:  # fmt: skip
    credits = 2
    links = _links(rank, world, transport, nodes=nodes, credits=credits, timeout_s=20.0, job=job)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    delivered = 0
    early: list = []  # messages of a later round, from a peer that is already there
    for seed in seeds:
        for round_ in range(rounds):
            stamp = seed * rounds + round_  # travels as the header's chunk
            plan = _round_plan(seed, round_, world, credits)
            mine = [(d, *msg) for d in ("next", "prev") for msg in plan[(rank, d)]]
            random.Random(seed + 7919 * rank + round_).shuffle(mine)  # cross-edge order: random per rank
            # Per channel the order must stay FIFO: re-sort each direction's messages by microbatch.
            for direction in ("next", "prev"):
                slots = [i for i, s in enumerate(mine) if s[0] == direction]
                ordered = sorted((mine[i] for i in slots), key=lambda s: s[1])
                for i, s in zip(slots, ordered, strict=True):
                    mine[i] = s
            expected = {("act", prv): plan[(prv, "next")], ("grad", nxt): plan[(nxt, "prev")]}
            got: dict = {key: [] for key in expected}

            def take(msg, got=got, stamp=stamp):
                item = (msg.header.chunk, msg.header.kind, msg.source_rank, msg.header.microbatch, msg.tensor.clone())
                links.release(msg)
                if item[0] == stamp:
                    got[(item[1], item[2])].append(item[3:])
                else:
                    assert item[0] > stamp, (item[:4], stamp)
                    early.append(item)

            for item in [e for e in early if e[0] == stamp]:
                early.remove(item)
                got[(item[1], item[2])].append(item[3:])

            for direction, mb, numel, dtype_index in mine:
                t = _content(rank, direction, mb, numel, dtype_index, seed)
                links.send(direction, t, header_for(t, "act" if direction == "next" else "grad", mb, stamp))
                while (msg := links.poll()) is not None:  # single-threaded, as the DPP runtime is
                    take(msg)
            while sum(map(len, got.values())) < sum(map(len, expected.values())):
                take(links.wait_any(20.0))
            for (kind, src), msgs in expected.items():
                direction = "next" if kind == "act" else "prev"
                assert [mb for mb, _ in got[(kind, src)]] == [m for m, _, _ in msgs], (seed, round_, kind, src, [mb for mb, _ in got[(kind, src)]], msgs)
                for (mb, tensor), (_, numel, dtype_index) in zip(got[(kind, src)], msgs, strict=True):
                    assert torch.equal(tensor, _content(src, direction, mb, numel, dtype_index, seed)), (seed, mb)
                delivered += len(msgs)
    links.close()
    return delivered


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("transport", "nodes"), [("gloo", ()), ("auto", (0, 0, 1, 1))], ids=["gloo", "auto-2+2"])
def test_randomized_send_orders_across_edges_complete(transport, nodes):
    seeds, rounds = list(range(25)), 4
    job = tagged(f"r{transport[0]}")
    counts = check_all_ok(run_processes(_random_order_scenario, 4, transport, nodes, seeds, rounds, job, timeout_s=200))
    expected = [0] * 4
    for seed in seeds:
        for round_ in range(rounds):
            for (src, direction), msgs in _round_plan(seed, round_, 4, 2).items():
                dst = (src + 1) % 4 if direction == "next" else (src - 1) % 4
                expected[dst] += len(msgs)
    assert counts == expected


# ---- no /dev/shm left after a killed peer in a mixed shm + gloo pipeline --------------------------------
def _killed_in_split_scenario(rank: int, world: int, job: str) -> str:
    links = _links(rank, world, "auto", nodes=(0, 0, 1, 1), credits=2, timeout_s=4.0, job=job)
    t = torch.ones(256 << 10, dtype=torch.uint8)
    if rank == 3:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        for m in range(10_000):
            links.send("next", t, header_for(t, "act", m, 0))
            links.send("prev", t, header_for(t, "grad", m, 0))
            for _ in range(2):
                links.release(links.wait_any(4.0))
    except TransportError as exc:
        links.close()
        return type(exc).__name__
    return "never failed"


@pytest.mark.timeout(90)
def test_killed_peer_in_a_2_plus_2_split_leaves_no_shared_memory():
    job = tagged("k")
    outcomes = run_processes(_killed_in_split_scenario, 4, job, timeout_s=60)
    assert outcomes[3].exitcode == -signal.SIGKILL, outcomes[3]
    survivors = check_all_ok(outcomes[:3])
    assert all(kind in ("TransportError", "TransportTimeout") for kind in survivors), survivors
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"mdpp-{job}")]


# ---- who reads the header lines -----------------------------------------------------------------------
def _readers_scenario(rank: int, world: int, transport: str, nodes: tuple[int, ...], job: str) -> tuple:
    links = _links(rank, world, transport, nodes=nodes, job=job)
    kinds = sorted(type(r).__name__ for r in links._receivers)
    # The receivers' own threads, not threading.enumerate(): a header thread ends once it reads its
    # peer's end of stream, which a fast peer can send before this rank gets here (CI saw it).
    header_threads = sorted(r._thread.name for r in links._receivers if getattr(r, "_thread", None) is not None)
    running = [t.name for t in threading.enumerate() if t.name.startswith("mdpp-headers")]
    assert set(running) <= set(header_threads), (running, header_threads)  # no header thread of anyone else's
    t = torch.full((5,), float(rank))
    links.send("next", t, header_for(t, "act", rank, 0))
    got = links.wait_any(10.0)
    value = got.tensor.tolist()
    links.release(got)
    links.close()
    return kinds, header_threads, value


@pytest.mark.timeout(90)
def test_all_header_line_ranks_read_their_lines_themselves_mixed_ranks_use_a_header_thread():
    """A rank that receives only on header lines polls them from its consumer (no thread hand-off);
    a rank that also receives on a shared-memory ring sleeps on the ring's doorbell, so its header
    lines keep a thread that puts arrivals into the inbox and rings it."""
    pure = check_all_ok(run_processes(_readers_scenario, 4, "gloo", (), tagged("p"), timeout_s=60))
    for rank, (kinds, threads, value) in enumerate(pure):
        assert kinds == ["PolledGroupReceiver"] * 2 and threads == [], (rank, kinds, threads)
        assert value == [float((rank - 1) % 4)] * 5
    mixed = check_all_ok(run_processes(_readers_scenario, 4, "auto", (0, 0, 1, 1), tagged("m"), timeout_s=60))
    for rank, (kinds, threads, value) in enumerate(mixed):
        # each rank has one ring and one header line incoming (edges 1<->2 and 3<->0 cross "nodes")
        assert "ProcessGroupReceiver" in kinds and len(threads) == 1, (rank, kinds, threads)
        assert value == [float((rank - 1) % 4)] * 5


def _dead_sender_scenario(rank: int, world: int) -> tuple[str, float]:
    links = _links(rank, world, credits=2, timeout_s=30.0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        links.wait_any(30.0)
    return str(info.value), time.monotonic() - start


@pytest.mark.timeout(60)
def test_a_dead_sender_is_seen_at_once_on_a_polled_line_not_at_the_timeout():
    outcomes = run_processes(_dead_sender_scenario, 2, timeout_s=50)
    assert outcomes[1].exitcode == -signal.SIGKILL, outcomes[1]
    message, elapsed = check_all_ok(outcomes[:1])[0]
    assert "rank 1" in message and "probably dead" in message, message
    assert elapsed < 5.0, elapsed  # the line's end, not the 30 s timeout
