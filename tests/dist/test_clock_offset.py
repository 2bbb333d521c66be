"""measure_clock_offset across real processes (gloo) whose clocks are skewed by known amounts."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from trainer.launch.ports import free_port
from trainer.profiling.clock import RoundTrip, best_offset

# Seconds-scale skews, far beyond the loopback round trip, in both directions.
SKEW_US = (0.0, 5_000_000.0, -3_250_000.0)
# The error of a min-RTT estimate is at most half the best round trip: ~0.1 ms over loopback gloo
# on an idle machine, tens of ms when the 2 cores are shared with other jobs. 50 ms is still 65x
# below the smallest skew, so a sign or bookkeeping error cannot pass.
TOLERANCE_US = 50_000.0
JOIN_TIMEOUT_S = 180


def _worker(rank: int, world_size: int, port: int, skews: tuple[float, ...], results,
            backend: str = "gloo") -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from trainer.profiling.clock import measure_clock_offset
    from trainer.profiling.tracer import now_us

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        skew = skews[rank]
        offset = measure_clock_offset(rounds=8, timeout_s=120, clock_us=lambda: now_us() + skew)
        results.put((rank, offset))
    finally:
        dist.destroy_process_group()


def _run_ranks(world_size: int, backend: str) -> dict[int, float]:
    """Offsets measured by ``world_size`` spawned ranks whose clocks are skewed by SKEW_US."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, SKEW_US, results, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 1))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks {alive} did not finish the clock sync in {JOIN_TIMEOUT_S} s"
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return dict(results.get(timeout=5) for _ in procs)


# ~5 s on an idle 2-core machine (three spawned interpreters import torch); the limits leave room
# for a machine shared with other jobs.
@pytest.mark.timeout(200)
def test_offsets_undo_injected_skew():
    offsets = _run_ranks(len(SKEW_US), "gloo")
    assert offsets[0] == 0.0
    for rank in (1, 2):
        expected = SKEW_US[0] - SKEW_US[rank]  # add to rank r's (skewed) clock to read rank 0's
        assert abs(offsets[rank] - expected) < TOLERANCE_US, (rank, offsets[rank], expected)


@pytest.mark.gpu
@pytest.mark.timeout(200)
def test_offsets_undo_injected_skew_over_nccl():
    """The CUDA path (NCCL moves only GPU tensors; the host must sync before reading its clock)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: NCCL cannot put two ranks on one device")
    offsets = _run_ranks(2, "nccl")
    assert offsets[0] == 0.0
    assert abs(offsets[1] - (SKEW_US[0] - SKEW_US[1])) < TOLERANCE_US, offsets


def test_best_offset_keeps_the_shortest_round_trip():
    noisy = RoundTrip(sent_us=0.0, root_us=900.0, received_us=1000.0)  # RTT 1000, offset 400
    clean = RoundTrip(sent_us=2000.0, root_us=2110.0, received_us=2020.0)  # RTT 20, offset 100
    assert best_offset([noisy, clean, noisy]) is clean
    assert clean.offset_us == pytest.approx(100.0)
    with pytest.raises(ValueError, match="at least one"):
        best_offset([])
