# ruff: noqa: E702
"""Where the NCCL path's ~200 us of host time per send goes (docs/transport.md, "Known limits").

    python scripts/device/nccl_send_cost.py [--size 8M] [--iters 200]

Two ranks on cuda:0/cuda:1. (1) The bare calls on one two-rank NCCL group (device_id bound, as the
edge groups are): host time of `dist.isend` / `dist.irecv` per call, ping-pong style. (2) A ping-pong
over the stage links' NCCL path with rank 0's `links.send` profiled (cProfile, top functions by
own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

from trainer.launch.local_ranks import check_all_ok, run_processes
from trainer.launch.topology import Topology
from trainer.transport.bench import parse_size
from trainer.transport.factory import make_stage_links
from trainer.transport.tensors import header_for

ns = time.perf_counter_ns


def _bare(rank, group, data, iters):
    peer = 1 - rank
    sends, recvs = [], []
    for _ in range(iters):
        if rank == 0:
            t = ns(); w = dist.isend(data, dst=peer, group=group); sends.append(ns() - t)
            t = ns(); r = dist.irecv(data, src=peer, group=group); recvs.append(ns() - t)
        else:
            t = ns(); r = dist.irecv(data, src=peer, group=group); recvs.append(ns() - t)
            t = ns(); w = dist.isend(data, dst=peer, group=group); sends.append(ns() - t)
        w.wait(); r.wait()
        torch.cuda.current_stream().synchronize()
    med = lambda xs: statistics.median(xs[10:]) / 1e3  # noqa: E731
    return {"isend us": med(sends), "irecv us": med(recvs)}


def _main(rank, world, cfg):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    group = dist.new_group([0, 1], backend="nccl", device_id=device)
    data = torch.ones(cfg["size"], dtype=torch.uint8, device=device)
    out = {"bare": _bare(rank, group, data, cfg["iters"])}
    topo = Topology(world_size=2, rank=rank, pipeline_parallel=2)
    links = make_stage_links(topo, "nccl", device, timeout_s=60)
    header = header_for(data, "act" if rank == 0 else "grad", 0, 0)
    direction = "next" if rank == 0 else "prev"
    profile = cProfile.Profile()
    times = []
    for it in range(cfg["iters"] + 20):
        if rank == 0:
            if it >= 20:
                profile.enable()
            t = ns(); links.send(direction, data, header); times.append(ns() - t)
            profile.disable()
            links.release(links.wait_any(60))
        else:
            links.release(links.wait_any(60))
            links.send(direction, data, header)
    torch.cuda.synchronize()
    links.close()
    if rank == 0:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        out["profile"] = text.getvalue()
        out["links.send us (median, with profiler)"] = statistics.median(times[20:]) / 1e3
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="8M")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nccl_send_cost  # picklable by its real name under spawn

    cfg = {"size": parse_size(args.size), "iters": args.iters}
    for rank, out in enumerate(check_all_ok(run_processes(nccl_send_cost._main, 2, cfg, timeout_s=240))):
        print(f"[nccl-cost] rank {rank} bare:", {k: round(v, 1) for k, v in out["bare"].items()})
        if "profile" in out:
            print("[nccl-cost] rank 0 links.send (median, under cProfile):", round(out["links.send us (median, with profiler)"], 1))
            print(out["profile"])


if __name__ == "__main__":
    main()
