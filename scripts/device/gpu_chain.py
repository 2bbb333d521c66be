"""GPU-side cost of one same-node hop, with no host in the loop (docs/transport.md): one process, two GPUs,
every operation of N hops queued up front, then one synchronize. Per hop (us):

  copies        back-to-back 8 MiB copies cuda:0 -> cuda:1 on one stream (the copy engine alone)
  torch copy_   the bench's "peer copy" baseline (torch's cross-device copy_)
  flag chain    hop i copies to the other GPU, then writes its flag; hop i+1 (the other GPU's stream)
                waits for that flag, copies back, writes ... (the transport's GPU ordering, minimal)
  + events      the same with the transport's two streams per GPU: the consumer stream waits for the
                flag and records an event, the side stream waits for it, then copies and signals

    python scripts/device/gpu_chain.py [--size 8M] [--hops 200]
"""

from __future__ import annotations

import argparse
import time

import torch

from trainer.transport import _cuda_hop
from trainer.transport.bench import parse_size
from trainer.transport.gpu_signals import device_context, made_event


def timed(fn, devices, hops):
    fn(8)  # warm-up
    for d in devices:
        torch.cuda.synchronize(d)
    t = time.perf_counter()
    fn(hops)
    for d in devices:
        torch.cuda.synchronize(d)
    return (time.perf_counter() - t) / hops * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="8M")
    p.add_argument("--hops", type=int, default=200)
    args = p.parse_args()
    n = parse_size(args.size)
    d = [torch.device("cuda", 0), torch.device("cuda", 1)]
    torch.cuda.set_device(d[0])
    buf = [torch.ones(n, dtype=torch.uint8, device=x) for x in d]
    buf[1].copy_(buf[0])  # torch enables peer access between the two
    buf[0].copy_(buf[1])
    ctx = [device_context(x) for x in d]
    side = [torch.cuda.Stream(x) for x in d]
    consumer = [torch.cuda.Stream(x) for x in d]
    events = [made_event(consumer[i]) for i in range(2)]
    state = {"count": 0}
    flags = [torch.zeros(1, dtype=torch.int32, device=x) for x in d]

    def copies(hops):
        for _ in range(hops):
            _cuda_hop.copy(ctx[0], side[0].cuda_stream, buf[1].data_ptr(), buf[0].data_ptr(), n)

    def torch_copies(hops):
        for _ in range(hops):
            buf[1].copy_(buf[0])

    def flag_chain(hops, with_events=False):
        for _ in range(hops):
            c = state["count"]
            src = c % 2
            dst = 1 - src
            if with_events:
                if c:
                    _cuda_hop.wait_geq(ctx[src], consumer[src].cuda_stream, flags[src].data_ptr(), c)
                _cuda_hop.record_event(ctx[src], events[src].cuda_event, consumer[src].cuda_stream)
                _cuda_hop.wait_event(ctx[src], side[src].cuda_stream, events[src].cuda_event)
            elif c:
                _cuda_hop.wait_geq(ctx[src], side[src].cuda_stream, flags[src].data_ptr(), c)
            _cuda_hop.copy(ctx[src], side[src].cuda_stream, buf[dst].data_ptr(), buf[src].data_ptr(), n)
            _cuda_hop.write(ctx[src], side[src].cuda_stream, flags[dst].data_ptr(), c + 1)
            state["count"] = c + 1

    results = {
        "copies": timed(copies, d, args.hops),
        "torch copy_": timed(torch_copies, d, args.hops),
        "flag chain": timed(flag_chain, d, args.hops),
        "+ events": timed(lambda h: flag_chain(h, True), d, args.hops),
    }
    for name, us in results.items():
        print(f"[chain] {args.size} {name:12s} {us:7.1f} us per hop ({n / us / 1e3:6.1f} GB/s)")


if __name__ == "__main__":
    main()
