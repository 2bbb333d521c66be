"""Where a same-node GPU hop spends its host time (docs/transport.md): a ping-pong over the shm (CUDA IPC)
links with every phase timestamped on the shared monotonic clock of both processes, then a loop of
each piece of the send/receive path alone on rank 0.

    python scripts/device/hop_profile.py [--sizes 64K,8M] [--iters 400]

Prints, per size, the median of each phase (us) and the host chain of one round trip. Two ranks
on cuda:0 and cuda:1 (or both on cuda:0 with one GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from trainer.launch.local_ranks import check_all_ok, run_processes
from trainer.launch.topology import Topology
from trainer.transport.bench import parse_size
from trainer.transport.factory import LinkOptions, make_stage_links
from trainer.transport.tensors import as_bytes, check_matches, header_for
from trainer.transport.wire import encode, pack

ns = time.perf_counter_ns


def _pingpong(rank, links, data, iters):
    """Per iteration: [send start, send end, wait_any end, tensor end, release end] on each rank."""
    header = header_for(data, "act" if rank == 0 else "grad", 0, 0)
    direction = "next" if rank == 0 else "prev"
    stamps = []
    dist.barrier()
    torch.cuda.synchronize()
    def send():
        start = ns()
        links.send(direction, data, header)
        return start, ns()

    def receive():
        message = links.wait_any(60)
        handed_out = ns()
        _ = message.tensor  # queues the stream's wait for the payload
        read = ns()
        links.release(message)
        return handed_out, read, ns()

    for _ in range(iters):
        if rank == 0:
            sent = send()
            stamps.append((*sent, *receive()))
        else:
            got = receive()
            stamps.append((*send(), *got))
    torch.cuda.synchronize()
    return stamps


def _pieces(links, data, iters=2000):
    """Rank 0 alone: the Python pieces of a send, each in a loop (us per call)."""
    sender = links._senders["next"] if hasattr(links, "_senders") else None
    out = {}

    def loop(name, fn):
        fn()
        t = ns()
        for _ in range(iters):
            fn()
        out[name] = (ns() - t) / iters / 1e3

    header = header_for(data, "act", 0, 0)
    stream = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    loop("header_for", lambda: header_for(data, "act", 0, 0))
    loop("check_matches", lambda: check_matches(data, header))
    loop("as_bytes", lambda: as_bytes(data))
    loop("encode+pack", lambda: pack(encode(header, 7)))
    loop("wait_stream", lambda: stream.wait_stream(cur))

    def ctx():
        with torch.cuda.stream(stream):
            pass

    loop("stream ctx", ctx)
    loop("record_stream", lambda: data.record_stream(stream))
    small = torch.empty(64, dtype=torch.uint8, device=data.device)
    src = torch.ones(64, dtype=torch.uint8, device=data.device)
    loop("copy_ 64B", lambda: small.copy_(src, non_blocking=True))
    slots = torch.empty(4, 1024, dtype=torch.uint8, device=data.device)
    loop("slot[k,:n] view", lambda: slots[1, :64])
    loop("event record", lambda: torch.cuda.Event().record(stream))
    if sender is not None:
        sig = sender._signals
        loop("signal write", lambda: sig.signal(stream.cuda_stream, 0, 0))
        loop("signal wait(0)", lambda: sig.wait(stream.cuda_stream, 0, 0))
    from trainer.transport.gpu_signals import current_stream_handle

    loop("current_stream_handle", lambda: current_stream_handle(data.device.index))
    loop("is_contiguous", lambda: data.is_contiguous())
    loop("data_ptr", lambda: data.data_ptr())
    torch.cuda.synchronize()
    return out


def _main(rank, world, cfg):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    topo = Topology(world_size=2, rank=rank, pipeline_parallel=2)
    links = make_stage_links(topo, cfg["transport"], device, timeout_s=60, options=LinkOptions(shm_slot_bytes=64 << 20))
    result = {}
    for size in cfg["sizes"]:
        data = torch.ones(size, dtype=torch.uint8, device=device)
        _pingpong(rank, links, data, 50)  # warm-up
        result[size] = _pingpong(rank, links, data, cfg["iters"])
    pieces = {}
    if rank == 0 and cfg["pieces"]:
        pieces = _pieces(links, torch.ones(64 << 10, dtype=torch.uint8, device=device))
    links.close()
    return {"stamps": result, "pieces": pieces}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="64K,8M")
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--transport", default="shm", choices=["shm", "nccl"])
    p.add_argument("--no-pieces", action="store_true")
    args = p.parse_args()
    cfg = {"sizes": [parse_size(s) for s in args.sizes.split(",")], "iters": args.iters,
           "transport": args.transport, "pieces": not args.no_pieces}
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hop_profile  # picklable by its real name under spawn (children inherit sys.path)

    r0, r1 = check_all_ok(run_processes(hop_profile._main, 2, cfg, timeout_s=300))
    med = lambda xs: statistics.median(xs) / 1e3  # noqa: E731
    for size in cfg["sizes"]:
        s0, s1 = r0["stamps"][size], r1["stamps"][size]
        n = len(s0)
        # rank 0: a=send start, b=send end, c=reply handed out, d=tensor, e=release
        # rank 1: c=message handed out, d, e, a=reply send start, b=reply send end
        rows = {
            "r0 send": [s0[i][1] - s0[i][0] for i in range(n)],
            "r0 send end -> r1 handed out": [s1[i][2] - s0[i][1] for i in range(n)],
            "r1 tensor": [s1[i][3] - s1[i][2] for i in range(n)],
            "r1 release": [s1[i][4] - s1[i][3] for i in range(n)],
            "r1 release -> send start": [s1[i][0] - s1[i][4] for i in range(n)],
            "r1 send": [s1[i][1] - s1[i][0] for i in range(n)],
            "r1 send end -> r0 handed out": [s0[i][2] - s1[i][1] for i in range(n)],
            "r0 tensor": [s0[i][3] - s0[i][2] for i in range(n)],
            "r0 release": [s0[i][4] - s0[i][3] for i in range(n)],
            "round trip (r0 send start -> next)": [s0[i + 1][0] - s0[i][0] for i in range(n - 1)],
        }
        print(f"[hop] {cfg['transport']}: size {size} bytes, {n} round trips, medians in us:")
        for name, xs in rows.items():
            print(f"[hop]   {name:40s} {med(xs):8.1f}   (p90 {sorted(xs)[int(0.9 * len(xs))] / 1e3:.1f})")
    for name, us in r0["pieces"].items():
        print(f"[hop] piece {name:20s} {us:7.2f} us/call")


if __name__ == "__main__":
    main()
