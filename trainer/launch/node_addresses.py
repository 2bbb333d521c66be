"""``--node-ips`` read the prototype's way (one address per rank) or per node, told apart by their count.

The prototype (MegatronDPP's README) takes "the infiniband IPs of the pods in the order of their GPU
ranks": one address per rank, ranks of one node repeating its address. This project's Slurm jobs pass
one address per node (workflows.nodes). Both are accepted; which one a list is follows from the world
size alone, so every rank reads it the same way before any process group exists:

- as many addresses as ranks: per rank; ranks with the same address share a node, and nodes are
  numbered in the order their address first appears;
- fewer, all distinct, dividing the world size: per node, in node order (which rank runs where then
  comes from the launcher: SLURM_NODEID, this host's address, or consecutive ranks per node);
- more than the world size, with repeats: per rank, the prototype's reading (rank r takes the r-th
  address, so the addresses past the last rank are not used; its single-node example lists 8 for 4
  ranks), provided the first world-size addresses form a valid per-rank list; the unused ones are
  kept in :attr:`NodeAddresses.unused`, which the trainer logs;
- anything else is refused, naming the count and what it could have been.

Pure (no torch, no sockets): trainer.config checks a list with it, trainer.launch.distributed places ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeAddresses:
    """A parsed ``--node-ips`` for one world size."""

    per_rank: bool
    """True: one address per rank (the prototype's form); False: one per node."""
    nodes: tuple[str, ...]
    """Distinct addresses in node order (the first is the rendezvous host without MASTER_ADDR)."""
    node_of_rank: tuple[int, ...] | None
    """Per-rank form: the node index of every rank; per-node form: None (the launcher places ranks)."""
    unused: tuple[str, ...] = ()
    """Per-rank form given more addresses than ranks: those past the last rank (not used)."""


def read_node_ips(node_ips: Sequence[str], world_size: int) -> tuple[NodeAddresses | None, list[str]]:
    """(parsed list, problems) of ``--node-ips`` for ``world_size`` ranks; every problem names the values."""
    ips = tuple(node_ips)
    if not ips:
        return None, []
    given = f"--node-ips={','.join(ips)}"
    distinct = tuple(dict.fromkeys(ips))
    if len(ips) == world_size:
        node_of_rank = tuple(distinct.index(ip) for ip in ips)
        counts = {ip: ips.count(ip) for ip in distinct}
        if len(set(counts.values())) > 1:
            return None, [f"{given} gives one address per rank ({world_size} ranks) but the nodes run different "
                          "numbers of ranks (" + ", ".join(f"{ip}: {n}" for ip, n in counts.items())
                          + "); every node must run the same number"]
        return NodeAddresses(True, distinct, node_of_rank), []
    if len(ips) > world_size and len(distinct) != len(ips):
        head, problems = read_node_ips(ips[:world_size], world_size)
        if head is not None and head.per_rank:
            return dataclasses.replace(head, unused=ips[world_size:]), []
        return None, [f"{given} has {len(ips)} addresses with repeats for {world_size} ranks: read one per rank "
                      f"as the prototype does, its first {world_size} fail: " + "; ".join(problems)]
    if len(distinct) != len(ips):
        return None, [f"{given} has {len(ips)} addresses with repeats: one address per rank needs exactly "
                      f"{world_size} (the world size), one per node needs distinct addresses"]
    if len(ips) > world_size or world_size % len(ips):
        return None, [f"{given} has {len(ips)} addresses: neither one per rank ({world_size}) nor one per node "
                      f"(a divisor of the world size {world_size}, every node running the same number of ranks)"]
    return NodeAddresses(False, distinct, None), []
