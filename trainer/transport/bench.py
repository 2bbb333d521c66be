"""Transport benchmark: one-way time and bandwidth per transport, beside baselines from the same run.

    python -m trainer.transport.bench --sizes 64K,1M,8M,64M,256M [--transports shm,gloo] [--device cpu|cuda]
    python -m trainer.transport.bench --device cuda --transports nccl --random-order --rounds 20

Spawns two processes itself (stage 0 and stage 1 of a pp=2 pipeline, one gloo rendezvous on a
free port). For every size it measures, median over ``--repeats``:

- one-way time: a true round trip timed on the initiating rank (stage 0 sends on "next", stage 1
  replies on "prev" after the message arrived, stage 0 stops the clock when the reply is usable:
  on GPU after a stream synchronize), averaged over a burst of round trips (after one untimed round
  trip, so the ranks' skew leaving the barrier is not counted), halved; bandwidth is size / one-way
  time;
- the same round trip with the receiving rank busy: a matmul loop on a side stream of its GPU (on
  CPU a thread doing matmuls) runs while it receives;
- stream bandwidth: stage 0 streams a burst of messages, stage 1 receives them (pipelined, so
  per-message overheads overlap).

Baselines, measured in the same run: ``torch.distributed`` blocking send/recv on a plain 2-rank
group ("send/recv": gloo on CPU, NCCL on GPU when the two ranks have distinct GPUs), and a
single-process copy (memcpy of the same bytes on CPU; a raw device-to-device peer copy on GPU).
Ratios are transport / baseline bandwidth, so > 1 means faster.

``--random-order --rounds N`` instead runs N rounds of a randomized exchange on every transport:
in each round both ranks send on both their channels, in a random order across the channels,
random sizes from ``--sizes`` (at most ``--credits`` per channel), and check every payload. It
prints one line per round and fails on the first error or timeout.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from trainer.cli import OneLineParser
from trainer.launch.local_ranks import check_all_ok, run_processes
from trainer.launch.topology import Topology
from trainer.problems import raise_if_any
from trainer.transport.factory import GPU_SIGNALS, GpuSignals, LinkOptions, make_stage_links
from trainer.transport.tensors import header_for

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_BURST_BYTES = 256 << 20  # bytes streamed per bandwidth sample (bounded below by _MIN_BURST messages)
_MIN_BURST, _MAX_BURST = 3, 100
_MIN_ROUND_TRIPS = 8  # per one-way sample (a 256 MiB round trip is ~1.6 ms on NVLink)


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
    """Bound on every transport wait; the whole two-process run is bounded by a multiple of it."""
    busy: bool = True
    """Also measure the round trip with the receiving rank busy (matmul loop)."""
    random_order: bool = False
    """Run the randomized-order exchange instead of the measurements."""
    rounds: int = 20
    """Rounds of the randomized-order exchange."""
    seed: int = 0
    gpu_signals: GpuSignals = "auto"
    """Same-node GPU channels: "flags", "events" or "auto" (LinkOptions.gpu_signals)."""

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
        if self.rounds < 1:
            problems.append(f"rounds={self.rounds} must be >= 1")
        raise_if_any(problems, "invalid benchmark settings")


@dataclass
class Row:
    """One size of one transport (or baseline): medians. NaN where not measured."""

    name: str
    size: int
    one_way_us: float
    """Half a round trip timed on the initiating rank."""
    bandwidth_gbs: float
    """size / one_way_us."""
    busy_one_way_us: float = math.nan
    """The same with the receiving rank's GPU (CPU: a core) busy with matmuls."""
    busy_bandwidth_gbs: float = math.nan
    stream_gbs: float = math.nan
    """Bandwidth of a pipelined burst, timed on the receiver."""
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

    def __init__(self, links, timeout_s: float) -> None:
        self.links, self.timeout_s = links, timeout_s

    def send(self, direction: str, tensor: torch.Tensor) -> None:
        kind = "act" if direction == "next" else "grad"
        self.links.send(direction, tensor, header_for(tensor, kind, 0, 0))

    def recv(self, like: torch.Tensor) -> None:
        message = self.links.wait_any(self.timeout_s)
        # Read the tensor: Message.tensor queues the stream's wait for the payload at the first read
        # (base.py). Without it neither the reply nor rank 0's clock waits for the data, and a
        # "round trip" times the headers only (the 4xH100 figures of 2026-11-26 evening did).
        message.tensor  # noqa: B018
        self.links.release(message)


class _DistPair:
    """The baseline: blocking torch.distributed send/recv on a plain two-rank group."""

    def __init__(self, group, rank: int) -> None:
        self.group, self.peer = group, 1 - rank

    def send(self, direction: str, tensor: torch.Tensor) -> None:
        dist.send(tensor, dst=self.peer, group=self.group)

    def recv(self, like: torch.Tensor) -> None:
        dist.recv(like, src=self.peer, group=self.group)


class _BusyLoop:
    """Matmuls on the receiving rank while it receives: a side stream of its GPU, or a CPU thread."""

    def __init__(self, device: torch.device) -> None:
        self._device, self._stop = device, threading.Event()
        n = 4096 if device.type == "cuda" else 256
        self._a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        self._thread = threading.Thread(target=self._loop, name="mdpp-bench-busy", daemon=True)

    def _loop(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
            side = torch.cuda.Stream(self._device)
            with torch.cuda.stream(side):
                while not self._stop.is_set():
                    for _ in range(8):
                        torch.mm(self._a, self._a)
                    side.synchronize()  # keep the queue short, so stop() is prompt
        else:
            while not self._stop.is_set():
                torch.mm(self._a, self._a)

    def __enter__(self) -> _BusyLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _round_trips(pair, rank: int, size: int, data: torch.Tensor, sink: torch.Tensor, device) -> float:
    """One sample of the one-way time (us): a burst of ping-pongs timed on rank 0, halved.

    One untimed round trip first: the two ranks leave a barrier up to ~0.1 ms apart (its last
    message; more on the VMs here), and the first message may find the receiver asleep -- costs of
    starting, which a burst of 16 round trips (8 MiB) would spread as ~5 us over every hop."""

    def round_trip() -> None:
        if rank == 0:
            pair.send("next", data)
            pair.recv(sink)
        else:
            pair.recv(sink)
            pair.send("prev", data)  # stream-ordered after the receive on GPU

    count = max(_MIN_ROUND_TRIPS, _burst(size) // 2)
    dist.barrier()
    _settle(device)
    round_trip()
    start = time.perf_counter()
    for _ in range(count):
        round_trip()
    _settle(device)  # rank 0: the last reply is usable
    return (time.perf_counter() - start) / count / 2 * 1e6


def _stream(pair, rank: int, size: int, data: torch.Tensor, sink: torch.Tensor, device) -> float:
    """One sample of the pipelined bandwidth (GB/s), valid on rank 1 (the receiver)."""
    burst = _burst(size)
    dist.barrier()
    _settle(device)
    start = time.perf_counter()
    for _ in range(burst):
        pair.send("next", data) if rank == 0 else pair.recv(sink)
    _settle(device)
    return burst * size / (time.perf_counter() - start) / 1e9


def _copy_sample(size: int, src: torch.Tensor, dst: torch.Tensor) -> float:
    """One sample of memcpy (CPU) or a raw peer copy (GPU) of ``size`` bytes, in one process (us)."""
    burst = _burst(size)
    _settle(src.device)
    start = time.perf_counter()
    for _ in range(burst):  # a burst, like the transports: one small copy is below timer noise
        dst.copy_(src)
    _settle(src.device)
    _settle(dst.device)
    return (time.perf_counter() - start) / burst * 1e6


def _pairs(config: BenchConfig, rank: int, device: torch.device) -> tuple[dict, list]:
    topo = Topology(world_size=2, rank=rank, pipeline_parallel=2)
    options = LinkOptions(credits=config.credits, shm_slot_bytes=config.slot_bytes, gpu_signals=config.gpu_signals)
    pairs, links = {}, []
    for transport in config.transports:
        links.append(make_stage_links(topo, transport, device, timeout_s=config.timeout_s, options=options))
        pairs[transport] = _LinksPair(links[-1], config.timeout_s)
    return pairs, links


def _rank_main(rank: int, world: int, config: BenchConfig) -> list[dict]:
    """Measure every transport and baseline, interleaved: each repeat samples all of them in turn,
    so a load change on a shared machine hits transports and baselines alike."""
    torch.set_num_threads(1)  # one thread per process: the memcpy baseline is one thread, like the ring's copy
    device = _device(config, rank)
    pairs, links = _pairs(config, rank, device)
    if config.device == "cpu" or torch.cuda.device_count() > 1:  # NCCL refuses two ranks on one GPU
        pairs["send/recv"] = _DistPair(dist.new_group([0, 1], backend="gloo" if config.device == "cpu" else "nccl"), rank)
    copy_name = "memcpy" if config.device == "cpu" else "peer copy"
    # The copy baseline reads the other rank's GPU (not made current: this rank keeps its own).
    copy_src_device = torch.device("cuda", 1 % torch.cuda.device_count()) if config.device == "cuda" else device
    rows = []
    for size in config.sizes:
        data = torch.ones(size, dtype=torch.uint8, device=device)
        sink = torch.empty_like(data)
        copy_src = torch.ones(size, dtype=torch.uint8, device=copy_src_device) if rank == 0 else None
        samples: dict[str, dict[str, list[float]]] = {
            name: {"one_way": [], "busy": [], "stream": []} for name in [*pairs, copy_name]
        }
        for repeat in range(config.repeats + 1):  # the first round warms up (page faults, lazy set-up)
            for name, pair in pairs.items():
                kept = samples[name] if repeat else {"one_way": [], "busy": [], "stream": []}
                kept["one_way"].append(_round_trips(pair, rank, size, data, sink, device))
                kept["stream"].append(_stream(pair, rank, size, data, sink, device))
                if config.busy:
                    dist.barrier()
                    if rank == 1:  # the receiving side of the "next" message is busy
                        with _BusyLoop(device):
                            kept["busy"].append(_round_trips(pair, rank, size, data, sink, device))
                    else:
                        kept["busy"].append(_round_trips(pair, rank, size, data, sink, device))
            if rank == 0 and repeat:
                samples[copy_name]["one_way"].append(_copy_sample(size, copy_src, sink))
            dist.barrier()
        # One-way and busy times are valid on rank 0 (the initiator), stream bandwidth on rank 1.
        streams: list = [None, None]
        dist.all_gather_object(streams, {n: v["stream"] for n, v in samples.items()})
        if rank == 0:
            for name, values in samples.items():
                one_way = statistics.median(values["one_way"])
                busy = statistics.median(values["busy"]) if values["busy"] else math.nan
                stream = streams[1][name]
                rows.append(Row(name, size, one_way, size / one_way / 1e3, busy,
                                size / busy / 1e3 if busy == busy else math.nan,
                                statistics.median(stream) if stream else math.nan))  # fmt: skip
        del data, sink, copy_src
    for link in links:
        link.close()
    dist.barrier()
    return [asdict(r) for r in rows] if rank == 0 else []


# ---- randomized order ----------------------------------------------------------------------------------
def _round_messages(config: BenchConfig, round_: int) -> dict[tuple[int, str], list[int]]:
    """Sizes each rank sends per channel in one round (the same on both ranks)."""
    rng = random.Random(config.seed * 100_003 + round_)
    return {(src, d): [rng.choice(config.sizes) for _ in range(rng.randint(0, config.credits))]
            for src in (0, 1) for d in ("next", "prev")}  # fmt: skip


def _fill(src: int, direction: str, round_: int, index: int) -> int:
    return (src * 31 + (direction == "next") * 17 + round_ * 7 + index * 3) % 251


def _random_main(rank: int, world: int, config: BenchConfig) -> list[dict]:
    """Every transport, ``rounds`` rounds of randomized cross-channel send order; content checked."""
    device = _device(config, rank)
    _, links = _pairs(config, rank, device)
    peer, report = 1 - rank, []
    for transport, link in zip(config.transports, links, strict=True):
        for round_ in range(config.rounds):
            plan = _round_messages(config, round_)
            mine = [(d, i, n) for d in ("next", "prev") for i, n in enumerate(plan[(rank, d)])]
            random.Random(config.seed + 1_000_003 * rank + round_).shuffle(mine)
            for direction in ("next", "prev"):  # FIFO within a channel: indices stay in order
                slots = [k for k, m in enumerate(mine) if m[0] == direction]
                for k, m in zip(slots, sorted((mine[k] for k in slots), key=lambda m: m[1]), strict=True):
                    mine[k] = m
            expected = {("act", i): n for i, n in enumerate(plan[(peer, "next")])}
            expected |= {("grad", i): n for i, n in enumerate(plan[(peer, "prev")])}
            seen: set = set()
            start = time.perf_counter()

            def check(msg, round_=round_, seen=seen, expected=expected, link=link, transport=transport):
                key = (msg.header.kind, msg.header.microbatch)
                direction = "next" if msg.header.kind == "act" else "prev"
                want = _fill(peer, direction, round_, key[1])
                ok = msg.header.chunk == round_ and key in expected and msg.tensor.numel() == expected[key]
                ok = ok and key not in seen and bool((msg.tensor == want).all())
                link.release(msg)
                if not ok:
                    raise AssertionError(f"rank {rank}: {transport} round {round_}: wrong message {msg.header}")
                seen.add(key)

            for direction, index, nbytes in mine:
                t = torch.full((nbytes,), _fill(rank, direction, round_, index), dtype=torch.uint8, device=device)
                link.send(direction, t, header_for(t, "act" if direction == "next" else "grad", index, round_))
                while (msg := link.poll()) is not None:
                    check(msg)
            while len(seen) < len(expected):
                check(link.wait_any(config.timeout_s))
            dist.barrier()  # rounds do not overlap: a later round's message is never taken early
            report.append({"transport": transport, "round": round_, "messages": len(mine) + len(expected),
                           "seconds": time.perf_counter() - start})  # fmt: skip
    for link in links:
        link.close()
    return report if rank == 0 else []


# ---- report --------------------------------------------------------------------------------------------
def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _num(value: float, fmt: str) -> str:
    return "-" if value != value else format(value, fmt)  # NaN: not measured


def format_table(rows: list[dict], config: BenchConfig) -> str:
    by = {(r["name"], r["size"]): r for r in rows}
    copy_name = "memcpy" if config.device == "cpu" else "peer copy"
    header = (f"{'size':>6} {'transport':>10} {'1-way us':>9} {'GB/s':>8} {'busy us':>9} {'busy GB/s':>9} "
              f"{'busy x':>7} {'stream GB/s':>11} {'x send/recv':>11} {'x ' + copy_name:>11}")  # fmt: skip
    lines = [header]
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
            slowdown = row["busy_one_way_us"] / row["one_way_us"]
            lines.append(
                f"{format_size(size):>6} {name:>10} {row['one_way_us']:9.1f} {row['bandwidth_gbs']:8.2f} "
                f"{_num(row['busy_one_way_us'], '9.1f'):>9} {_num(row['busy_bandwidth_gbs'], '9.2f'):>9} "
                f"{_num(slowdown, '7.2f'):>7} {_num(row['stream_gbs'], '11.2f'):>11} {ratios[0]:>11} {ratios[1]:>11}"
            )
    return "\n".join(lines)


def run(config: BenchConfig) -> list[dict]:
    # Under `python -m` this module is __main__; the importable copy pickles by its real name.
    from trainer.transport import bench

    main_fn = bench._random_main if config.random_order else bench._rank_main
    outcomes = run_processes(main_fn, 2, config, timeout_s=config.timeout_s * 4)
    return check_all_ok(outcomes)[0]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.transport.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64K,1M,8M,64M,256M", help="comma-separated, K/M/G binary units")
    parser.add_argument("--transports", default=None, help="default: shm,gloo on cpu; shm,nccl on cuda (shm on one GPU)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--credits", type=int, default=4)
    parser.add_argument("--slot-bytes", default="64M", help="shm slot size (larger payloads are chunked)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--no-busy", action="store_true", help="skip the busy-receiver column")
    parser.add_argument("--random-order", action="store_true", help="randomized-order exchange instead of timing")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of --random-order")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random-order")
    parser.add_argument("--gpu-signals", default="auto", choices=GPU_SIGNALS,
                        help="same-node GPU channels: how slot filled/freed is signalled")
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
            slot_bytes=parse_size(args.slot_bytes), timeout_s=args.timeout, busy=not args.no_busy,
            random_order=args.random_order, rounds=args.rounds, seed=args.seed, gpu_signals=args.gpu_signals,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    started = time.time()
    rows = run(config)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{os.cpu_count()} CPU cores"
    if config.random_order:
        for r in rows:
            print(f"{r['transport']} round {r['round'] + 1}/{config.rounds}: ok, {r['messages']} messages, "
                  f"{r['seconds'] * 1e3:.1f} ms")  # fmt: skip
        print(f"# randomized order on {where}: {config.rounds} rounds in a row completed per transport "
              f"({', '.join(config.transports)}), seed {config.seed}, {time.time() - started:.0f}s")  # fmt: skip
    else:
        print(f"# transport benchmark on {where}: median of {config.repeats}, slot "
              f"{format_size(config.slot_bytes)}, credits {config.credits}, {time.time() - started:.0f}s")  # fmt: skip
        print(format_table(rows, config))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": asdict(config), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
