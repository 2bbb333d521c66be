"""Which CPUs each local rank may run on: the cores of its GPU's NUMA node, shared out among the
ranks on that node (``--cpu-bind numa`` of the benchmark's launcher; Slurm's ``--cpu-bind`` does the
same for srun jobs).

Why: a pipeline stage that is launch-bound (stage 0 of GPT16 on an H100 queues kernels as fast as its
host thread can) runs as fast as that thread. Unbound, the kernel may move it between sockets and
between cores shared with the other ranks' threads; a launch from the far socket pays the
cross-socket hop on every doorbell write. The same line then runs 650 ms in one iteration and 1050 ms
in the next, which hides a 3% difference between two lines behind noise.

:func:`plan_cpu_sets` is pure (the unit tests cover it); :func:`gpu_numa_nodes` and
:func:`node_cpus` read the machine (``nvidia-smi``, ``/sys``). Where the NUMA node of a GPU is not
known (``numa_node`` -1 on many VMs, no ``nvidia-smi``), the allowed CPUs are split evenly in rank
order, which still keeps each rank on cores of its own.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

SYS_PCI = Path("/sys/bus/pci/devices")
SYS_NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` (the kernel's cpulist format) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def format_cpu_list(cpus: Sequence[int]) -> str:
    """The inverse of :func:`parse_cpu_list` (ranges collapsed), for log lines."""
    parts, ordered = [], sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def plan_cpu_sets(ranks: int, allowed: Sequence[int], numa_of_rank: Sequence[int | None],
                  cpus_of_node: Mapping[int, Sequence[int]]) -> list[list[int]] | None:
    """CPU set per local rank, or None when there are fewer allowed CPUs than ranks (no binding).

    Ranks whose GPU sits on a known NUMA node share that node's allowed CPUs in contiguous, equal
    slices (rank order); the others share the allowed CPUs no known node claimed (all of them when no
    node is known). A node with fewer allowed CPUs than ranks on it falls back to the even split."""
    allowed = sorted(set(allowed))
    if ranks <= 0 or len(allowed) < ranks:
        return None
    if len(numa_of_rank) != ranks:
        raise ValueError(f"numa_of_rank has {len(numa_of_rank)} entries for {ranks} ranks")
    allowed_set = set(allowed)
    groups: dict[int | None, list[int]] = {}
    for rank, node in enumerate(numa_of_rank):
        usable = [c for c in cpus_of_node.get(node, ()) if c in allowed_set] if node is not None else []
        groups.setdefault(node if usable else None, []).append(rank)
    for node in [n for n in groups if n is not None]:
        usable = [c for c in cpus_of_node[node] if c in allowed_set]
        if len(usable) < len(groups[node]):
            groups.setdefault(None, []).extend(groups.pop(node))
    sets: list[list[int]] = [[] for _ in range(ranks)]
    claimed = {c for n in groups if n is not None for c in cpus_of_node[n]}
    for node, members in groups.items():
        pool = ([c for c in cpus_of_node[node] if c in allowed_set] if node is not None
                else [c for c in allowed if c not in claimed] or allowed)
        if len(pool) < len(members):
            pool = allowed
        share = len(pool) // len(members)
        for i, rank in enumerate(sorted(members)):
            sets[rank] = pool[i * share:(i + 1) * share]
    return sets


def _sysfs_bus_id(nvidia_bus_id: str) -> str:
    """``00000000:18:00.0`` (nvidia-smi: 8-digit domain, upper case) -> ``0000:18:00.0`` (sysfs)."""
    domain, _, rest = nvidia_bus_id.strip().partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def gpu_numa_nodes(count: int, visible: str | None = None) -> list[int | None]:
    """NUMA node of each of the first ``count`` visible GPUs (None where unknown), in CUDA's order
    for identical cards (PCI order, which is nvidia-smi's); ``visible`` = CUDA_VISIBLE_DEVICES."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return [None] * count
    bus_of = {}
    for line in out.splitlines():
        index, _, bus = line.partition(",")
        if bus.strip():
            bus_of[index.strip()] = _sysfs_bus_id(bus)
    order = [v.strip() for v in visible.split(",")] if visible else sorted(bus_of, key=int)
    nodes: list[int | None] = []
    for i in range(count):
        bus = bus_of.get(order[i]) if i < len(order) else None
        node = None
        if bus is not None:
            try:
                node = int((SYS_PCI / bus / "numa_node").read_text())
            except (OSError, ValueError):
                node = None
        nodes.append(node if node is not None and node >= 0 else None)
    return nodes


def node_cpus() -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from /sys (empty where the machine does not say)."""
    nodes: dict[int, list[int]] = {}
    for path in sorted(SYS_NODES.glob("node[0-9]*")):
        try:
            nodes[int(path.name[4:])] = parse_cpu_list((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def numa_cpu_sets(ranks: int, device: str) -> tuple[list[list[int]] | None, str]:
    """The CPU set of each local rank on this machine and a one-line account of the choice."""
    allowed = sorted(os.sched_getaffinity(0))
    numa = gpu_numa_nodes(ranks, os.environ.get("CUDA_VISIBLE_DEVICES")) if device == "cuda" else [None] * ranks
    sets = plan_cpu_sets(ranks, allowed, numa, node_cpus())
    if sets is None:
        return None, f"not bound: {len(allowed)} CPUs for {ranks} ranks"
    where = ", ".join(f"rank {r}: CPUs {format_cpu_list(s)} (NUMA node {numa[r] if numa[r] is not None else '?'})"
                      for r, s in enumerate(sets))
    return sets, f"bound {where}"
