"""``make_stage_links``: pick a transport per pipeline edge and build this rank's channels.

COLLECTIVE: every rank of the job must call :func:`make_stage_links` (same topology, transport and
options), including ranks whose own edges need no process group, because ``torch.distributed``
creates groups collectively and in the same order on every rank. ``torch.distributed`` must already
be initialised (any backend).

Edges: for every rank r with pipeline_parallel > 1, a "next" channel r -> next_stage_rank(r)
(activations, including interleaving's wrap-around p-1 -> 0) and a "prev" channel
r -> prev_stage_rank(r) (gradients). For pp == 2 both go to the same peer but stay distinct channels,
so gradients never wait behind activations. Peers always share tp and dp coordinates.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

from trainer.launch.run_token import agreed_run_token, remove_run_segments
from trainer.launch.topology import Topology
from trainer.names import TRANSPORTS, job_name_part
from trainer.problems import raise_if_any
from trainer.transport.base import Direction, StageLinks
from trainer.transport.channels import ChannelStageLinks, Inbox, RecvChannel, SendChannel
from trainer.transport.dist_links import PolledGroupReceiver, ProcessGroupReceiver, ProcessGroupSender
from trainer.transport.dist_progress import DistProgress, HeaderBell
from trainer.transport.edge_groups import build_edge_groups

log = logging.getLogger(__name__)

DIRECTIONS: tuple[Direction, Direction] = ("next", "prev")


GpuSignals = Literal["auto", "flags", "events"]
"""How same-node GPU channels signal "slot filled/freed" (LinkOptions.gpu_signals, the transport
benchmark's --gpu-signals)."""
GPU_SIGNALS: tuple[str, ...] = get_args(GpuSignals)


@dataclass(frozen=True)
class LinkOptions:
    """Tuning knobs of the stage links (the defaults suit an 8 MiB activation)."""

    credits: int = 4
    """Receive slots per channel (K): how many messages may be in flight before send() waits."""
    shm_slot_bytes: int = 16 << 20
    """Bytes per shared-memory slot; a larger payload is split over several slots (and copied once
    more on the receiver, so size slots to the usual activation)."""
    poll_interval_s: float = 0.05
    """How often a blocked shm wait wakes to check that its peer process is still alive."""
    gpu_signals: GpuSignals = "auto"
    """Same-node GPU channels: how "slot filled/freed" is signalled between the processes
    (trainer.transport.gpu_signals): "flags" (driver stream memory operations), "events"
    (interprocess CUDA events), or "auto" (flags where the driver allows them)."""

    def __post_init__(self) -> None:
        problems = []
        if self.gpu_signals not in GPU_SIGNALS:
            problems.append(f"gpu_signals={self.gpu_signals!r} must be one of {', '.join(GPU_SIGNALS)}")
        if self.credits < 1:
            problems.append(f"credits={self.credits} must be >= 1")
        if self.shm_slot_bytes < 4096 or self.shm_slot_bytes % 64:
            problems.append(f"shm_slot_bytes={self.shm_slot_bytes} must be >= 4096 and a multiple of 64")
        if not 0 < self.poll_interval_s <= 5:
            problems.append(f"poll_interval_s={self.poll_interval_s} must be in (0, 5]")
        raise_if_any(problems, "invalid LinkOptions")


@dataclass(frozen=True)
class ChannelSpec:
    """One directed channel of the job: ``src`` sends ``direction`` messages to ``dst`` over ``transport``."""

    src: int
    dst: int
    direction: Direction
    transport: str
    """"shm", "gloo" or "nccl" (never "auto": resolved per edge)."""


def plan_channels(topology: Topology, transport: str, device: torch.device) -> list[ChannelSpec]:
    """Every channel of the job, in the order all ranks create them (pure; same on every rank)."""
    _validate(transport, device)
    if topology.pipeline_parallel == 1:
        return []
    remote = "nccl" if device.type == "cuda" else "gloo"
    plan = []
    for src in range(topology.world_size):
        view = dataclasses.replace(topology, rank=src)
        for direction in DIRECTIONS:
            dst = view.next_stage_rank if direction == "next" else view.prev_stage_rank
            same_node = topology.same_node(src, dst)
            chosen = transport
            if transport == "auto":
                chosen = "shm" if same_node else remote
            elif transport == "shm" and not same_node:
                raise ValueError(
                    f"transport='shm' but ranks {src} (node {topology.node(src)}) and {dst} "
                    f"(node {topology.node(dst)}) are on different nodes; use 'auto'"
                )
            plan.append(ChannelSpec(src, dst, direction, chosen))
    return plan


def _validate(transport: str, device: torch.device) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not one of {', '.join(TRANSPORTS)}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device} must be a cpu or cuda device")
    if transport == "gloo" and device.type != "cpu":
        raise ValueError(f"transport='gloo' moves CPU tensors, but device={device}")
    if transport == "nccl" and device.type != "cuda":
        raise ValueError(f"transport='nccl' moves CUDA tensors, but device={device}")


def make_stage_links(
    topology: Topology,
    transport: str = "auto",
    device: torch.device | str | None = None,
    timeout_s: float = 300.0,
    job_id: str | None = None,
    options: LinkOptions | None = None,
) -> StageLinks:
    """Build this rank's stage links. COLLECTIVE over all ranks (see module docstring).

    ``device``: where tensors live ("cpu" when None). ``timeout_s`` bounds every wait (send on
    exhausted credits, set-up, close). ``job_id`` makes shared-memory names unique per job (default:
    a new run token agreed between ranks, see trainer.launch.run_token).
    """
    device = torch.device(device if device is not None else "cpu")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    options = options or LinkOptions()
    plan = plan_channels(topology, transport, device)
    if plan and not dist.is_initialized():
        raise RuntimeError("make_stage_links needs torch.distributed initialised (init_process_group)")
    if plan and topology.world_size != dist.get_world_size():
        raise ValueError(
            f"topology.world_size={topology.world_size} but torch.distributed has {dist.get_world_size()} ranks"
        )
    rank, inbox = topology.rank, Inbox()
    senders: dict[Direction, SendChannel] = {}
    receivers: list[RecvChannel] = []
    shm_specs = [s for s in plan if s.transport == "shm"]
    dist_specs = [s for s in plan if s.transport != "shm"]
    # Every rank, same order; NCCL communicators are connected here, not at first use.
    edge_list = [(s.src, s.dst, s.direction, s.transport) for s in dist_specs]
    edges = build_edge_groups(edge_list, rank, device, timeout_s)
    progress = DistProgress()  # this rank's gloo/NCCL receivers and the lock its operations go under
    # A rank that receives on no shared-memory ring reads its header lines itself (no header thread,
    # one thread wake-up less per message) and sleeps on them; one that does sleeps on the rings'
    # doorbell, which its header threads ring.
    polled = not any(s.dst == rank for s in shm_specs)
    for spec in dist_specs:
        if rank == spec.src:
            edge = edges[(spec.src, spec.dst, spec.direction)]
            senders[spec.direction] = ProcessGroupSender(rank, edge, device, options.credits, progress)
        elif rank == spec.dst:
            edge = edges[(spec.src, spec.dst, spec.direction)]
            kind = PolledGroupReceiver if polled else ProcessGroupReceiver
            receivers.append(kind(rank, edge, device, options.credits, inbox, progress, timeout_s))
    if polled and receivers:
        inbox.doorbell = HeaderBell(list(receivers))
    if shm_specs:
        # Set-up needs a few collectives whatever the default backend is (NCCL needs devices set).
        setup_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        job = _agreed_job_id(job_id, setup_group)
        try:
            shm_senders, shm_receivers = _build_same_node_channels(
                shm_specs, rank, device, job, timeout_s, options, inbox, setup_group)
        except BaseException:
            # A peer died or never came (the set-up collective failed or timed out), or this rank
            # failed: segments the dead or failing ranks created would stay in /dev/shm forever,
            # and every rank of the run knows their names. The survivors on each host remove them.
            remove_run_segments(job)
            raise
        senders.update(shm_senders)
        receivers.extend(shm_receivers)
    description = " ".join(f"{s.direction}:{s.src}->{s.dst}:{s.transport}" for s in plan if rank in (s.src, s.dst))
    log.info("rank %d: stage links %s", rank, description or "(none: pipeline_parallel == 1)")
    return ChannelStageLinks(rank, senders, receivers, inbox, timeout_s, description, options.poll_interval_s)


def _build_same_node_channels(
    specs: list[ChannelSpec], rank: int, device: torch.device, job: str, timeout_s: float,
    options: LinkOptions, inbox: Inbox, group: dist.ProcessGroup,
) -> tuple[dict, list]:  # fmt: skip
    """This rank's shared-memory channels. COLLECTIVE over ``group``."""
    if device.type == "cuda":  # GPU payloads in peer GPU memory; the C++ ring carries headers
        from trainer.transport.cuda_peer import build_cuda_peer_channels

        return build_cuda_peer_channels(specs, rank, device, job, timeout_s, options, inbox, group)
    from trainer.transport.shm_links import build_shm_channels  # the C++ extension, imported only when used

    return build_shm_channels(specs, rank, job, timeout_s, options, inbox, group)


def _agreed_job_id(job_id: str | None, group: dist.ProcessGroup) -> str:
    """A short token, identical on all ranks, that makes shared-memory names unique to this job:
    ``job_id`` when the caller has one (trainer.train passes its run token), else a new run token
    (trainer.launch.run_token.agreed_run_token, the one place that draws them: torchrun's default
    TORCHELASTIC_RUN_ID "none" or a requeued Slurm job's id alone would repeat names, and a leftover
    segment would block). The names themselves are trainer.names's."""
    if job_id:
        return job_name_part(job_id)
    return agreed_run_token(group)
