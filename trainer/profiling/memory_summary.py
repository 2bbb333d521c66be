"""Where a rank's reserved GPU memory goes, from an allocator snapshot (--record-memory-history):

    python -m trainer.profiling.memory_summary snapshot_rank0.pickle [more.pickle ...] [--top N]

Per snapshot: the reserved memory per pool at the snapshot (the ordinary pool, and each private pool: a
CUDA graph's, which holds its captures' memory, free or not, until the graph goes), the ordinary pool's
live tensors by the code that allocated them, and the peak of reserved memory over the recorded
history with the allocation that made the allocator ask CUDA for the segment that reached it.
Pure reading (no GPU needed): the snapshot is torch.cuda.memory._snapshot()'s dictionary."""

from __future__ import annotations

import argparse
import pickle
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.cli import OneLineParser

GIB, MIB = 2**30, 2**20
ORDINARY = (0, 0)
"""segment_pool_id of the allocator's ordinary pool; any other id is a private pool (CUDA graphs)."""
OWN_CODE = ("/trainer/", "/megatron/", "/tests/")
"""Frames worth naming: the first of them in a stack says who allocated (not torch's internals)."""
GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass(frozen=True)
class Peak:
    reserved: int
    """Reserved bytes at the peak of the recorded history."""
    start: int
    """Reserved bytes where the recorded history begins (its window may start after set-up)."""
    size: int
    """The segment whose allocation reached the peak."""
    pool: str
    where: str
    """Who asked for the memory that needed that segment."""
    index: int
    events: int


def pool_name(pool_id: Any) -> str:
    return "ordinary pool" if tuple(pool_id) == ORDINARY else f"private pool {tuple(pool_id)} (CUDA graphs)"


def allocated_by(frames: list[dict]) -> str:
    """The first frame of the project's or megatron-core's code in a stack (else the innermost one)."""
    for f in frames:
        if any(part in f.get("filename", "") for part in OWN_CODE):
            return f"{_short(f['filename'])}:{f.get('line', '?')} {f.get('name', '')}"
    return f"{_short(frames[0]['filename'])}:{frames[0].get('line', '?')} {frames[0].get('name', '')}" if frames \
        else "(no stack recorded)"


def _short(filename: str) -> str:
    for part in OWN_CODE + ("/torch/",):
        if part in filename:
            return part.strip("/") + "/" + filename.split(part, 1)[1]
    return filename


def pools(snapshot: dict) -> dict[str, tuple[int, int, int]]:
    """Pool name -> (reserved, allocated, segments) at the snapshot, largest reserved first."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for seg in snapshot.get("segments", []):
        entry = out[pool_name(seg.get("segment_pool_id", ORDINARY))]
        entry[0] += seg["total_size"]
        entry[1] += seg["allocated_size"]
        entry[2] += 1
    return {k: (v[0], v[1], v[2]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][0])}


def live_tensors(snapshot: dict, pool: tuple[int, int] = ORDINARY) -> list[tuple[str, int, int]]:
    """(allocated by, bytes, blocks) of a pool's live blocks at the snapshot, largest first."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for seg in snapshot.get("segments", []):
        if tuple(seg.get("segment_pool_id", ORDINARY)) != pool:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                entry = out[allocated_by(block.get("frames", []))]
                entry[0] += block["size"]
                entry[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in out.items()), key=lambda t: -t[1])


def peak(snapshot: dict, device: int = 0) -> Peak | None:
    """The largest reserved total over the recorded history, or None without one (recording was off)."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    if not trace:
        return None
    now = sum(seg["total_size"] for seg in snapshot.get("segments", []))
    start = now - sum(GROWS.get(e["action"], 0) * e["size"] for e in trace)
    reserved, best, best_at = start, start, -1
    for i, e in enumerate(trace):
        reserved += GROWS.get(e["action"], 0) * e["size"]
        if reserved > best:
            best, best_at = reserved, i
    if best_at < 0:
        return Peak(best, start, 0, "", "the window's start (no segment was added after it)", -1, len(trace))
    seg = trace[best_at]
    by_address = {s["address"]: s.get("segment_pool_id", ORDINARY) for s in snapshot.get("segments", [])}
    pool = pool_name(by_address[seg["addr"]]) if seg.get("addr") in by_address else "a segment freed since"
    # The segment was added for the allocation that follows it in the trace (same stream); name its stack.
    asked = next((e for e in trace[best_at + 1:best_at + 4] if e["action"] == "alloc"), seg)
    return Peak(best, start, seg["size"], pool, allocated_by(asked.get("frames", [])), best_at, len(trace))


def report(snapshot: dict, top: int = 12) -> list[str]:
    lines = ["reserved by pool at the snapshot:"]
    total = 0
    for name, (reserved, allocated, count) in pools(snapshot).items():
        total += reserved
        lines.append(f"  {reserved / GIB:7.2f} GiB reserved, {allocated / GIB:6.2f} GiB allocated, "
                     f"{count:4d} segment(s): {name}")
    lines.append(f"  {total / GIB:7.2f} GiB in all")
    lines.append(f"ordinary pool's live tensors by who allocated them (top {top}):")
    for where, size, blocks in live_tensors(snapshot)[:top]:
        lines.append(f"  {size / MIB:9.1f} MiB in {blocks:4d} block(s): {where}")
    p = peak(snapshot)
    if p is None:
        lines.append("no allocator history in this snapshot (recorded without --record-memory-history?)")
    else:
        lines.append(f"peak reserved over the recorded history: {p.reserved / GIB:.2f} GiB (the window of "
                     f"{p.events} events starts at {p.start / GIB:.2f} GiB)")
        if p.index >= 0:
            lines.append(f"  reached at event {p.index} by a {p.size / MIB:.1f} MiB segment ({p.pool}) for: {p.where}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.profiling.memory_summary", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshots", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12, help="how many allocating places to list")
    args = parser.parse_args(argv)
    code = 0
    for path in args.snapshots:
        try:
            with open(path, "rb") as f:
                snapshot = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError) as err:
            print(f"{path}: cannot read a snapshot: {err}", file=sys.stderr)
            code = 1
            continue
        if not isinstance(snapshot, dict) or "segments" not in snapshot:
            print(f"{path}: not an allocator snapshot (no 'segments')", file=sys.stderr)
            code = 1
            continue
        print(f"== {path}")
        print("\n".join(report(snapshot, args.top)))
    return code


if __name__ == "__main__":
    sys.exit(main())
