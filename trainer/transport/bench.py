"""Transport benchmark: bandwidth and latency per transport, beside baselines from the same run.

    python -m trainer.transport.bench --sizes 64K,1M,8M,64M,256M [--transports shm,gloo] [--device cpu|cuda]

Spawns two processes itself (stage 0 and stage 1 of a pp=2 pipeline, one gloo rendezvous on a
free port). For every size it measures, median over ``--repeats``:

- bandwidth: stage 0 streams a burst of messages on its "next" channel, stage 1 receives (and
  releases) them; bytes / time from a common start to the last arrival;
- latency: ping-pong (next, then the reply on prev), half the round trip.

Baselines, measured in the same run: ``torch.distributed`` blocking send/recv on a plain 2-rank
group (gloo on CPU, NCCL on GPU when the two ranks have distinct GPUs), and a single-process copy
(memcpy of the same bytes on CPU; a raw device-to-device peer copy on GPU). Ratios are
transport / baseline, so > 1 means faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from trainer.topology import Topology
from trainer.transport.factory import LinkOptions, make_stage_links
from trainer.transport.spawn import check_all_ok, run_processes
from trainer.transport.tensors import header_for

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_BURST_BYTES = 256 << 20  # bytes streamed per bandwidth sample (bounded below by _MIN_BURST messages)
_MIN_BURST, _MAX_BURST = 3, 100


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536 (binary units: K, M, G; optional trailing B / iB)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in _UNITS else (raw, "")
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with an optional K/M/G unit") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


@dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    sizes: tuple[int, ...]
    """Payload sizes in bytes."""
    transports: tuple[str, ...]
    """Transports under test: "shm", "gloo" (CPU), "nccl" (GPU)."""
    device: str = "cpu"
    """"cpu" or "cuda" (rank r uses cuda:r mod device_count)."""
    repeats: int = 5
    """Samples per measurement; the median is reported."""
    credits: int = 4
    """Receive slots per channel."""
    slot_bytes: int = 64 << 20
    """shm slot size; larger payloads are chunked (and copied once more on the receiver)."""
    timeout_s: float = 120.0
    """Bound on every transport wait and on the whole two-process run (x4)."""

    def __post_init__(self) -> None:
        allowed = {"cpu": {"shm", "gloo"}, "cuda": {"shm", "nccl"}}
        problems = []
        if self.device not in allowed:
            problems.append(f"device={self.device!r} must be 'cpu' or 'cuda'")
        else:
            bad = [t for t in self.transports if t not in allowed[self.device]]
            if bad or not self.transports:
                problems.append(f"transports={list(self.transports)} must be from {sorted(allowed[self.device])}")
        if not self.sizes or any(s <= 0 for s in self.sizes):
            problems.append(f"sizes={list(self.sizes)} must be positive byte counts")
        if self.repeats < 1:
            problems.append(f"repeats={self.repeats} must be >= 1")
        if self.credits < 1:
            problems.append(f"credits={self.credits} must be >= 1")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s={self.timeout_s} must be > 0")
        if problems:
            raise ValueError("invalid benchmark settings: " + "; ".join(problems))


@dataclass
class Row:
    """One size of one transport (or baseline): medians."""

    name: str
    size: int
    bandwidth_gbs: float
    latency_us: float
    samples: dict = field(default_factory=dict)


# ---- measurements inside the two ranks ----------------------------------------------------------------
def _device(config: BenchConfig, rank: int) -> torch.device:
    if config.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _settle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # measurement boundary, not the hot path


def _burst(size: int) -> int:
    return max(_MIN_BURST, min(_MAX_BURST, _BURST_BYTES // size))


class _LinksPair:
    """send/recv callables over our stage links, so transports and baselines share one timing loop."""

    def __init__(self, links) -> None:
        self.links = links

    def send(self, direction: str, tensor: torch.Tensor) -> None:
        kind = "act" if direction == "next" else "grad"
        self.links.send(direction, tensor, header_for(tensor, kind, 0, 0))

    def recv(self, like: torch.Tensor) -> None:
        self.links.release(self.links.wait_any(120.0))


class _DistPair:
    """The baseline: blocking torch.distributed send/recv on a plain two-rank group."""

    def __init__(self, group, rank: int) -> None:
        self.group, self.peer = group, 1 - rank

    def send(self, direction: str, tensor: torch.Tensor) -> None:
        dist.send(tensor, dst=self.peer, group=self.group)

    def recv(self, like: torch.Tensor) -> None:
        dist.recv(like, src=self.peer, group=self.group)


def _pair_sample(pair, rank: int, size: int, data: torch.Tensor, sink: torch.Tensor, device) -> tuple[float, float]:
    """One (bandwidth GB/s, one-way latency us) sample of a two-rank pair; valid on rank 1."""
    burst = _burst(size)
    dist.barrier()
    _settle(device)
    start = time.perf_counter()
    for _ in range(burst):
        pair.send("next", data) if rank == 0 else pair.recv(sink)
    _settle(device)
    bandwidth = burst * size / (time.perf_counter() - start) / 1e9
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        pair.send("next", data)
        pair.recv(sink)
    else:
        pair.recv(sink)
        pair.send("prev", data)
    _settle(device)
    return bandwidth, (time.perf_counter() - start) / 2 * 1e6


def _copy_sample(size: int, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float]:
    """One sample of memcpy (CPU) or a raw peer copy (GPU) of ``size`` bytes, in one process."""
    burst = _burst(size)
    _settle(src.device)
    start = time.perf_counter()
    for _ in range(burst):  # a burst, like the transports: one small copy is below timer noise
        dst.copy_(src)
    _settle(src.device)
    _settle(dst.device)
    seconds = (time.perf_counter() - start) / burst
    return size / seconds / 1e9, seconds * 1e6


def _rank_main(rank: int, world: int, config: BenchConfig) -> list[dict]:
    """Measure every transport and baseline, interleaved: each repeat samples all of them in turn,
    so a load change on a shared machine hits transports and baselines alike."""
    torch.set_num_threads(1)  # one thread per process: the memcpy baseline is one thread, like the ring's copy
    device = _device(config, rank)
    topo = Topology(world_size=2, rank=rank, pipeline_parallel=2)
    options = LinkOptions(credits=config.credits, shm_slot_bytes=config.slot_bytes)
    pairs, links = {}, []
    for transport in config.transports:
        links.append(make_stage_links(topo, transport, device, timeout_s=config.timeout_s, options=options))
        pairs[transport] = _LinksPair(links[-1])
    if config.device == "cpu" or torch.cuda.device_count() > 1:  # NCCL refuses two ranks on one GPU
        pairs["send/recv"] = _DistPair(dist.new_group([0, 1], backend="gloo" if config.device == "cpu" else "nccl"), rank)
    copy_name = "memcpy" if config.device == "cpu" else "peer copy"
    copy_src_device = _device(config, 0) if config.device == "cuda" else device
    rows = []
    for size in config.sizes:
        data = torch.ones(size, dtype=torch.uint8, device=device)
        sink = torch.empty_like(data)
        copy_src = torch.ones(size, dtype=torch.uint8, device=copy_src_device) if rank == 1 else None
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in [*pairs, copy_name]}
        for _ in range(config.repeats + 1):  # the first round warms up (page faults, lazy set-up)
            for name, pair in pairs.items():
                samples[name].append(_pair_sample(pair, rank, size, data, sink, device))
            if rank == 1:
                samples[copy_name].append(_copy_sample(size, copy_src, sink))
            dist.barrier()
        for name, values in samples.items():
            if rank == 1:
                measured = values[1:]
                rows.append(Row(name, size, statistics.median(b for b, _ in measured), statistics.median(t for _, t in measured)))
        del data, sink, copy_src
    for link in links:
        link.close()
    dist.barrier()
    return [asdict(r) for r in rows] if rank == 1 else []


# ---- report --------------------------------------------------------------------------------------------
def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def format_table(rows: list[dict], config: BenchConfig) -> str:
    by = {(r["name"], r["size"]): r for r in rows}
    copy_name = "memcpy" if config.device == "cpu" else "peer copy"
    lines = [
        f"{'size':>6} {'transport':>10} {'GB/s':>8} {'lat us':>9} {'x send/recv':>12} {'x ' + copy_name:>12}"
    ]
    for size in config.sizes:
        for name in (*config.transports, "send/recv", copy_name):
            row = by.get((name, size))
            if row is None:
                continue
            ratios = []
            for base in ("send/recv", copy_name):
                ref = by.get((base, size))
                ok = ref is not None and name != base and ref["bandwidth_gbs"] > 0
                ratios.append(f"{row['bandwidth_gbs'] / ref['bandwidth_gbs']:.2f}" if ok else "-")
            lines.append(
                f"{format_size(size):>6} {name:>10} {row['bandwidth_gbs']:8.2f} {row['latency_us']:9.1f} "
                f"{ratios[0]:>12} {ratios[1]:>12}"
            )
    return "\n".join(lines)


def run(config: BenchConfig) -> list[dict]:
    # Under `python -m` this module is __main__; the importable copy pickles by its real name.
    from trainer.transport.bench import _rank_main as rank_main

    outcomes = run_processes(rank_main, 2, config, timeout_s=config.timeout_s * 4)
    return check_all_ok(outcomes)[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.transport.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64K,1M,8M,64M,256M", help="comma-separated, K/M/G binary units")
    parser.add_argument("--transports", default=None, help="default: shm,gloo on cpu; shm,nccl on cuda (shm on one GPU)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--credits", type=int, default=4)
    parser.add_argument("--slot-bytes", default="64M", help="shm slot size (larger payloads are chunked)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    default_transports = "shm,gloo" if args.device == "cpu" else "shm,nccl"
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        default_transports = "shm"  # both ranks share the one GPU: CUDA IPC works, NCCL refuses
    try:
        config = BenchConfig(
            sizes=tuple(parse_size(s) for s in args.sizes.split(",")),
            transports=tuple((args.transports or default_transports).split(",")),
            device=args.device, repeats=args.repeats, credits=args.credits,
            slot_bytes=parse_size(args.slot_bytes), timeout_s=args.timeout,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    started = time.time()
    rows = run(config)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{os.cpu_count()} CPU cores"
    print(f"# transport benchmark on {where}: median of {config.repeats}, slot {format_size(config.slot_bytes)}, "
          f"credits {config.credits}, {time.time() - started:.0f}s")  # fmt: skip
    print(format_table(rows, config))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": asdict(config), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
