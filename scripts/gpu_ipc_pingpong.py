"""Diagnostic: what does one cross-process GPU hand-off cost, without our transport?

Two processes on GPU ``--device`` (and ``--peer-device``) ping-pong ``--rounds`` times over a pipe:
  host   : only the pipe (the floor set by process wake-ups);
  gpu    : each side launches a tiny kernel, records an interprocess CUDA event, and the other side
           makes its stream wait on that event and synchronises its own work before answering.
Prints the median one-way latency in µs of each mode. With both processes on ONE GPU the gpu mode
also pays CUDA's time-slicing between the two contexts, which two GPUs do not.

    python scripts/gpu_ipc_pingpong.py --rounds 2000 [--peer-device 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from trainer.cli import OneLineParser


def _side(rank: int, conn, device: int, rounds: int, mode: str, events_q, result_q) -> None:
    torch.cuda.set_device(device)
    x = torch.zeros(1, device="cuda")
    mine = torch.cuda.Event(interprocess=True)
    events_q.put((rank, mine.ipc_handle()))
    theirs = None
    while theirs is None:
        r, h = events_q.get()
        if r != rank:
            theirs = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), h)
        else:
            events_q.put((r, h))
            time.sleep(0.01)
    samples = []
    for i in range(rounds + 100):
        if rank == 0:
            t0 = time.perf_counter()
            if mode == "gpu":
                x.add_(1)
                mine.record()
            conn.send_bytes(b"x")
            conn.recv_bytes()
            if mode == "gpu":
                torch.cuda.current_stream().wait_event(theirs)
                x.add_(1)
                torch.cuda.current_stream().synchronize()
            if i >= 100:
                samples.append((time.perf_counter() - t0) / 2 * 1e6)
        else:
            conn.recv_bytes()
            if mode == "gpu":
                torch.cuda.current_stream().wait_event(theirs)
                x.add_(1)
                mine.record()
                mine.synchronize()  # what a receiver does before answering: its data is ready
            conn.send_bytes(b"x")
    if rank == 0:
        result_q.put(statistics.median(samples))


def measure(mode: str, devices: tuple[int, int], rounds: int) -> float:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    events_q, result_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_side, args=(r, (a, b)[r], devices[r], rounds, mode, events_q, result_q))
             for r in (0, 1)]
    for p in procs:
        p.start()
    value = result_q.get(timeout=300)
    for p in procs:
        p.join(60)
    return value


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python scripts/gpu_ipc_pingpong.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--peer-device", type=int, default=None, help="default: the same GPU")
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args(argv)
    devices = (args.device, args.device if args.peer_device is None else args.peer_device)
    print(f"{torch.cuda.get_device_name(devices[0])}, devices {devices}, median of {args.rounds}")
    for mode in ("host", "gpu"):
        print(f"  {mode:5s} one-way latency: {measure(mode, devices, args.rounds):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
