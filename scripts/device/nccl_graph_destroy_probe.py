"""Does destroying a process group wait for a CUDA graph that captured one of its collectives?

Two ranks (one GPU each) capture an all-reduce over a two-rank subgroup in a CUDA graph -- what a
slot graph holds at TP=2 -- replay it, synchronise, then destroy every group, either after
``graph.reset()`` (``--free``: the trainer's tear-down order) or with the graph still alive
(``--keep``). Each rank prints how long each destroy took; past ``--deadline`` seconds it prints
where it waits (faulthandler, every thread) and exits 1. Expected with NCCL >= 2.26: ``--free``
exits 0 in well under a second, ``--keep`` hits the deadline in ``destroy_process_group``.

    python3 -m torch.distributed.run --nproc_per_node 2 scripts/device/nccl_graph_destroy_probe.py --free
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--free", action="store_true", help="graph.reset() before destroying the groups")
    mode.add_argument("--keep", action="store_true", help="destroy the groups with the graph alive")
    ap.add_argument("--deadline", type=float, default=30.0, help="seconds the destroys may take")
    args = ap.parse_args()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    tp = dist.new_group([0, 1])  # a TP group of its own, as megatron-core makes one
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x, group=tp)  # the communicator starts eagerly: a capture cannot start it
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        dist.all_reduce(x, group=tp)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    ok = x[0].item() == 2.0 ** 4  # eager 2, then the three replays double it: 16
    print(f"rank {rank}: nccl {torch.cuda.nccl.version()}, replays {'right' if ok else 'WRONG'} ({x[0].item()})",
          flush=True)
    if args.free:
        graph.reset()
    faulthandler.dump_traceback_later(args.deadline, exit=True)  # exit status 1, stacks on stderr
    started = time.monotonic()
    dist.destroy_process_group(tp)
    print(f"rank {rank}: TP group destroyed in {time.monotonic() - started:.2f} s", flush=True)
    started = time.monotonic()
    dist.destroy_process_group()
    print(f"rank {rank}: default group destroyed in {time.monotonic() - started:.2f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    del graph
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
