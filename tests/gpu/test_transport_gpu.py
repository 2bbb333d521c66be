"""GPU transport on real CUDA processes (marked gpu: CI has no GPU; run through the device tool).

Two processes share one GPU when only one is visible (CUDA IPC works within a device too), else
use cuda:0 and cuda:1 (peer copies over NVLink/PCIe). NCCL needs two distinct GPUs.

    python -m pytest -m gpu tests/gpu/test_transport_gpu.py -v
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from trainer.launch.local_ranks import check_all_ok, run_processes
from trainer.launch.topology import Topology
from trainer.transport import TransportError, TransportTimeout
from trainer.transport.factory import LinkOptions, make_stage_links
from trainer.transport.tensors import header_for

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool]
SIZES = [0, 1, 1023, 65537, 2_000_003]  # the last spans several 1 MiB slots


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count())


def _links(rank: int, world: int, transport: str, **options):
    device = _device(rank)
    torch.cuda.set_device(device)
    topo = Topology(world_size=world, rank=rank, pipeline_parallel=world)
    return make_stage_links(topo, transport, device, timeout_s=30.0, options=LinkOptions(**options)), device


def _payload(seed: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    values = torch.randn(numel, generator=gen, device=device) * 50
    return values.gt(0) if dtype == torch.bool else values.to(dtype)


def _cases():
    return [(i, n, d) for i, (n, d) in enumerate((n, d) for n in SIZES for d in DTYPES)]


def _exchange_scenario(rank: int, world: int, transport: str) -> int:
    transport, _, signals = transport.partition("-")  # "shm-flags", "shm-events", "nccl"
    options = {"gpu_signals": signals} if signals else {}
    links, device = _links(rank, world, transport, shm_slot_bytes=1 << 20, credits=3, **options)
    direction, kind, peer = ("next", "act", 1) if rank == 0 else ("prev", "grad", 0)
    if transport == "shm":  # any host synchronisation on the hot path raises (NCCL's receiver
        torch.cuda.set_sync_debug_mode("error")  # thread must read each header back: not checked)

    def send_all():
        torch.cuda.set_device(device)
        for i, numel, dtype in _cases():
            t = _payload(100 * rank + i, 2 * numel, dtype, device)[::2]  # non-contiguous input
            links.send(direction, t, header_for(t, kind, i, 0))
            del t  # the transport must keep the source alive until its copy ran

    thread = threading.Thread(target=send_all)
    thread.start()
    received = []
    for _ in _cases():
        msg = links.wait_any(30)
        received.append((msg.header, msg.tensor.clone()))  # on the current stream, after the event wait
        msg.tensor.zero_()  # scribble on the slot before releasing it: the next sender must not care
        links.release(msg)
    thread.join(60)
    torch.cuda.set_sync_debug_mode("default")
    for (header, tensor), (i, numel, dtype) in zip(received, _cases(), strict=True):
        expected = _payload(100 * peer + i, 2 * numel, dtype, device)[::2]
        assert header.microbatch == i and tensor.device == device
        assert torch.equal(tensor, expected), f"message {i} ({numel} x {dtype}) corrupted"
    links.close()
    return len(received)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["shm-flags", "shm-events", "nccl"])
def test_gpu_exchange_ordering_integrity_without_host_sync(transport):
    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot put two ranks on one GPU: needs 2 GPUs")
    assert check_all_ok(run_processes(_exchange_scenario, 2, transport, timeout_s=150)) == [len(_cases())] * 2


def _killed_scenario(rank: int, world: int) -> str:
    links, device = _links(rank, world, "shm", shm_slot_bytes=1 << 20, credits=2)
    if rank == 1:
        big = torch.ones(8 << 20, dtype=torch.uint8, device=device)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            links.send("prev", big, header_for(big, "grad", 0, 0))
    time.sleep(0.2)
    try:
        while True:
            links.release(links.wait_any(15.0))
    except TransportError as exc:
        assert not isinstance(exc, TransportTimeout), exc
        return str(exc)


@pytest.mark.timeout(120)
def test_gpu_peer_killed_is_reported_naming_it():
    survivor, killed = run_processes(_killed_scenario, 2, timeout_s=90)
    assert killed.exitcode == -signal.SIGKILL
    assert "rank 1" in check_all_ok([survivor])[0]


def _landed_scenario(rank: int, world: int, transport: str) -> tuple:
    """Rank 0 queues ~1.5 s of GPU sleep, then sends: its header goes at once, its data only after the
    sleep. Rank 1 asks StageLinks.landed as soon as the header is in (must say no), then until yes."""
    transport, _, signals = transport.partition("-")
    options = {"gpu_signals": signals} if signals else {}
    links, device = _links(rank, world, transport, shm_slot_bytes=1 << 20, credits=3, **options)
    if rank == 0:
        t = torch.ones(4096, device=device)
        links.send("next", t, header_for(t, "act", 0, 0))  # a first message: lazy set-up out of the way
        links.wait_any(30)  # rank 1 has it: both sides are past their set-up
        t * 2  # loads the kernel now: a lazily loaded module's first launch waits for the GPU to idle
        torch.cuda._sleep(int(1.5 * 2e9))  # ~1.5 s at ~2 GHz, on the stream the send orders after
        start = time.monotonic()
        links.send("next", t * 2, header_for(t, "act", 1, 0))
        sent = time.monotonic() - start
        links.wait_any(30)  # the receiver's "done": keep the channel open until then
        links.close()
        return True, True, 0.0, sent
    warm = links.wait_any(30)
    links.landed(warm)  # the landed probe's set-up, on a message that is here
    links.release(warm)
    links.send("prev", torch.zeros(1, device=device), header_for(torch.zeros(1), "grad", 0, 0))
    msg = links.wait_any(30)
    got = time.monotonic()
    first = links.landed(msg)
    while not links.landed(msg):
        assert time.monotonic() - got < 10, "rank 1: the payload never showed as landed"
        time.sleep(0.001)
    waited = time.monotonic() - got
    correct = bool(torch.equal(msg.tensor, torch.full((4096,), 2.0, device=device)))
    links.release(msg)
    links.send("prev", torch.zeros(1, device=device), header_for(torch.zeros(1), "grad", 1, 0))
    links.close()
    return first, correct, waited, got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm-flags", "shm-events", "nccl"])
def test_landed_says_no_until_the_payload_is_on_the_gpu(transport):
    """StageLinks.landed (dpp-zb's fill_transit reads it): a header that came before its data (the
    sender queued the send behind long GPU work) is reported in transit, then landed."""
    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs two GPUs")
    outcomes = check_all_ok(run_processes(_landed_scenario, 2, transport, timeout_s=100))
    first, correct, waited, _ = outcomes[1]
    assert outcomes[0][3] < 0.3, f"rank 0's send took {outcomes[0][3]:.3f} s of host time: it waited for its GPU"
    assert first is False and correct, outcomes
    assert waited > 0.3, f"landed {waited:.3f} s after its header: the 1.5 s of sleep should show ({outcomes})"
