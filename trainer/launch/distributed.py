"""Launcher environment -> process groups -> :class:`Topology` and megatron-core's parallel state.

Two launchers are supported and read *before* any process group exists (so a bad layout fails
first): torchrun (RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT) and
one srun task per rank (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_NODEID, with
MASTER_ADDR / MASTER_PORT exported by the sbatch script). The node index of every rank comes from the
launcher (SLURM_NODEID, else --node-ips given one address per rank, else the position of this host in
--node-ips given per node, else rank // LOCAL_WORLD_SIZE or // --num-gpus) and is all-gathered into
``Topology.node_of_rank`` — never derived from hostnames.

``MDPP_NODE_OF_RANK=0,0,1,1`` (one node index per global rank) overrides all of them. It exists to
make ranks of one host act as several nodes, so edges between the "nodes" take the cross-node
transport (NCCL/gloo) and can be tested against the same-node one on a single machine.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.launch.node_addresses import read_node_ips
from trainer.launch.rendezvous import rendezvous, rendezvous_timeout
from trainer.launch.topology import Topology
from trainer.problems import raise_if_any

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The launcher's environment is missing or inconsistent (message names the variable)."""


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process."""

    rank: int
    world_size: int
    local_rank: int
    """Index among the ranks of this node (selects the GPU)."""
    node_index: int
    """Which node this rank runs on, as the launcher numbers them."""
    master_addr: str
    master_port: int
    launcher: str
    """"torchrun", "slurm" or "single" (no launcher: one process)."""


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError as exc:
        raise LaunchError(f"environment variable {name} is not set") from exc
    except ValueError as exc:
        raise LaunchError(f"environment variable {name}={env[name]!r} is not an integer") from exc


def _node_from_ips(node_ips: Sequence[str]) -> int | None:
    """Position of this host in --node-ips, matching any of its addresses or its name."""
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    for index, ip in enumerate(node_ips):
        if ip in names:
            return index
    return None


NODE_OVERRIDE_ENV = "MDPP_NODE_OF_RANK"


def node_override(text: str, world_size: int) -> tuple[int, ...]:
    """Parse ``MDPP_NODE_OF_RANK`` ("0,0,1,1": the node index of every global rank, in rank order)."""
    try:
        nodes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise LaunchError(f"{NODE_OVERRIDE_ENV}={text!r} must be comma-separated node indices, e.g. 0,0,1,1") from None
    if len(nodes) != world_size or min(nodes) < 0:
        raise LaunchError(
            f"{NODE_OVERRIDE_ENV}={text!r} must give one node index >= 0 per rank ({world_size} ranks)"
        )
    return nodes


def ranks_per_node_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """Ranks the launcher started on each node, where it says so (None: unknown or uneven):
    torchrun's LOCAL_WORLD_SIZE, else srun's per-step task counts ("4" or "4(x2)")."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        value = env.get("LOCAL_WORLD_SIZE", "")
        return int(value) if value.isdigit() else None
    if "SLURM_PROCID" in env:
        counts = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        per_node = {part.split("(")[0] for part in counts.split(",") if part}
        if len(per_node) == 1 and next(iter(per_node)).isdigit():
            return int(next(iter(per_node)))
    return None


def read_launch_env(env: Mapping[str, str] | None = None, node_ips: Sequence[str] = (),
                    num_gpus: int | None = None) -> LaunchInfo:
    """Rank, world size and node of this process from torchrun's or Slurm's variables; ``node_ips``
    and ``num_gpus`` (the prototype's flags) place ranks where the launcher does not."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        per_node = num_gpus or world
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % per_node
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else per_node
        launcher = "torchrun"
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else None
        addresses, problems = read_node_ips(node_ips, world)
        raise_if_any(problems, error=LaunchError)
        if addresses is not None and addresses.unused and rank == 0:
            log.warning("--node-ips: %d address(es) past rank %d not used (%s): one address per rank, rank r "
                        "takes the r-th, as the prototype reads the list", len(addresses.unused), world - 1,
                        ",".join(addresses.unused))
        if node is None and addresses is not None:
            node = addresses.node_of_rank[rank] if addresses.per_rank else _node_from_ips(addresses.nodes)
        if node is None:
            node = rank // max(local_world, 1)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        launcher = "slurm"
    else:
        rank, world, local_rank, node, launcher = 0, 1, 0, 0, "single"
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is outside world size {world}")
    if NODE_OVERRIDE_ENV in env:
        node = node_override(env[NODE_OVERRIDE_ENV], world)[rank]
    addr = env.get("MASTER_ADDR") or (node_ips[0] if node_ips else "127.0.0.1")  # rank 0's, in either form
    if world > 1 and "MASTER_PORT" not in env:
        raise LaunchError("environment variable MASTER_PORT is not set (the launcher must export it)")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500
    return LaunchInfo(rank, world, local_rank, node, addr, port, launcher)


def init_process_group(
    launch: LaunchInfo, device: str, timeout_s: float = 600.0, backend_choice: str = "auto"
) -> torch.device:
    """Create the default process group (NCCL on CUDA, gloo on CPU, unless ``backend_choice`` names
    one); returns this rank's device. ``timeout_s`` bounds its collectives; the rendezvous before it
    has a deadline of its own (trainer.launch.rendezvous: RENDEZVOUS_TIMEOUT_S, or
    $MDPP_RENDEZVOUS_TIMEOUT), past which a rank fails naming what it waited for."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise LaunchError("--device cuda but torch sees no CUDA device (use --device cpu)")
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl" if backend_choice == "auto" else backend_choice
    else:
        if backend_choice == "nccl":
            raise LaunchError("--distributed-backend nccl needs --device cuda")
        dev, backend = torch.device("cpu"), "gloo"
    store = rendezvous(launch.rank, launch.world_size, launch.master_addr, launch.master_port,
                       rendezvous_timeout())
    store.set_timeout(datetime.timedelta(seconds=timeout_s))  # every rank is there: collectives' bound from now on
    dist.init_process_group(backend=backend, store=store, rank=launch.rank, world_size=launch.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dev


def gather_nodes(launch: LaunchInfo) -> tuple[int, ...]:
    """All-gather every rank's node index (a small CPU/gloo-compatible object collective)."""
    nodes: list[int | None] = [None] * launch.world_size
    dist.all_gather_object(nodes, launch.node_index)
    return tuple(int(n) for n in nodes)  # type: ignore[arg-type]


def build_topology(launch: LaunchInfo, tp: int, pp: int, vp: int) -> Topology:
    return Topology(world_size=launch.world_size, rank=launch.rank, tensor_parallel=tp,
                    pipeline_parallel=pp, virtual_pipeline=vp, node_of_rank=gather_nodes(launch))


def init_megatron_parallel(topology: Topology) -> None:
    """megatron-core's groups with the same rank order as :class:`Topology` (tp fastest, pp slowest)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=topology.tensor_parallel,
        pipeline_model_parallel_size=topology.pipeline_parallel,
        virtual_pipeline_model_parallel_size=(
            topology.virtual_pipeline if topology.virtual_pipeline > 1 else None),
        order="tp-cp-ep-dp-pp",
    )
    tp, dp, pp = topology.coords()
    # Cheap guard that both numberings agree: everything downstream relies on it.
    assert (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank()) == (tp, dp, pp), \
        "megatron-core's rank order differs from trainer.launch.topology's"


GROUPS_DESTROY_TIMEOUT_S = 60.0
"""Deadline on destroying every process group at the end of a run (seconds; a healthy destroy takes
well under one). Past it the rank says where it waits and exits 1 (trainer.launch.exit_deadline);
shorter than trainer.train's stack dump over the whole tear-down (--dpp-timeout + 60 s), so the named
report comes first."""


def shutdown(rank: int | None = None, graph_groups: Mapping[str, object] | None = None,
             timeout_s: float = GROUPS_DESTROY_TIMEOUT_S) -> None:
    """Destroy megatron's groups and the default group (idempotent), under a deadline naming the rank.

    ``graph_groups``: name -> process group whose collectives were captured in CUDA graphs (the
    tensor-parallel group with --dpp-cuda-graphs at TP > 1). Each is destroyed first and on its own,
    so a hang names the group: NCCL's communicator destroy waits for every graph that captured one of
    its collectives, so the caller frees those graphs before calling this
    (trainer/pipeline/graph_teardown.py)."""
    from trainer.launch.exit_deadline import ExitDeadline

    me = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else -1)
    with ExitDeadline(me, timeout_s, "destroying the process groups") as deadline:
        for name, group in (graph_groups or {}).items():
            if group is None or not dist.is_initialized():
                continue
            deadline.enter(f"destroying the {name} group, whose collectives were captured in CUDA graphs (a "
                           "graph still alive keeps ncclCommDestroy waiting)")
            dist.destroy_process_group(group)
        deadline.enter("clearing megatron-core's parallel state")
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("destroy_model_parallel failed", exc_info=True)
        if dist.is_initialized():
            deadline.enter("destroying the remaining process groups")
            dist.destroy_process_group()
