"""The one topology object: who is who in a DP x TP x PP (x VP) job, and which ranks share a node.

Rank order follows Megatron-Core's default ``tp-cp-ep-dp-pp`` (tensor-parallel fastest, pipeline
slowest), so ``global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)`` and our ranks agree with the
process groups that ``megatron.core.parallel_state.initialize_model_parallel`` builds.

Node membership comes from the launcher (node index per rank: SLURM_NODEID / --node-ips / torchrun's
LOCAL_WORLD_SIZE), never from hostnames: two test "nodes" may share one host
(docs/transport.md#transports).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.problems import raise_if_any


@dataclass(frozen=True)
class Topology:
    """Parallel layout of one job, seen from one rank."""

    world_size: int
    """Total number of ranks (processes)."""
    rank: int
    """This process's global rank."""
    tensor_parallel: int = 1
    """TP size (``--tensor-model-parallel-size``); TP groups never span nodes."""
    pipeline_parallel: int = 1
    """PP size (``--pipeline-model-parallel-size``): number of pipeline stages."""
    virtual_pipeline: int = 1
    """Model chunks per stage (v); chunk c of stage s is virtual stage ``c * pp + s``."""
    node_of_rank: tuple[int, ...] = field(default=())
    """Node index of every global rank; empty means all ranks on node 0."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("world_size", "tensor_parallel", "pipeline_parallel", "virtual_pipeline"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if not problems and self.world_size % (self.tensor_parallel * self.pipeline_parallel):
            problems.append(
                f"world_size={self.world_size} is not divisible by tensor_parallel={self.tensor_parallel}"
                f" x pipeline_parallel={self.pipeline_parallel}"
            )
        if not 0 <= self.rank < max(self.world_size, 1):
            problems.append(f"rank={self.rank} is outside [0, world_size={self.world_size})")
        if self.node_of_rank and len(self.node_of_rank) != self.world_size:
            problems.append(
                f"node_of_rank has {len(self.node_of_rank)} entries but world_size={self.world_size}"
            )
        raise_if_any(problems, "invalid parallel layout")

    # ---- sizes and coordinates -------------------------------------------------------------
    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    def coords(self, rank: int | None = None) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        tp_rank = r % self.tensor_parallel
        dp_rank = (r // self.tensor_parallel) % self.data_parallel
        pp_rank = r // (self.tensor_parallel * self.data_parallel)
        return tp_rank, dp_rank, pp_rank

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tensor_parallel * (dp_rank + self.data_parallel * pp_rank)

    @property
    def tp_rank(self) -> int:
        return self.coords()[0]

    @property
    def dp_rank(self) -> int:
        return self.coords()[1]

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.coords()[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline_parallel - 1

    # ---- pipeline neighbours (a ring, so interleaving's wrap-around edges exist) ---------------
    @property
    def next_stage_rank(self) -> int:
        """Rank that receives this stage's activations (stage s+1 mod pp, same tp/dp coordinates)."""
        tp, dp, pp = self.coords()
        return self.rank_of(tp, dp, (pp + 1) % self.pipeline_parallel)

    @property
    def prev_stage_rank(self) -> int:
        """Rank that receives this stage's input gradients (stage s-1 mod pp)."""
        tp, dp, pp = self.coords()
        return self.rank_of(tp, dp, (pp - 1) % self.pipeline_parallel)

    def tp_group_ranks(self) -> list[int]:
        _, dp, pp = self.coords()
        return [self.rank_of(t, dp, pp) for t in range(self.tensor_parallel)]

    # ---- nodes ---------------------------------------------------------------------------------
    def node(self, rank: int | None = None) -> int:
        r = self.rank if rank is None else rank
        return self.node_of_rank[r] if self.node_of_rank else 0

    def same_node(self, a: int, b: int) -> bool:
        return self.node(a) == self.node(b)

    def describe(self) -> str:
        """One line summary of the layout, logged at start-up."""
        nodes = len(set(self.node_of_rank)) if self.node_of_rank else 1
        return (
            f"world={self.world_size} nodes={nodes} TP={self.tensor_parallel} "
            f"PP={self.pipeline_parallel} VP={self.virtual_pipeline} DP={self.data_parallel}"
        )


def nodes_from_local_world_size(world_size: int, local_world_size: int) -> tuple[int, ...]:
    """Node index per rank for launchers that place ``local_world_size`` consecutive ranks per node."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"world_size={world_size} is not a multiple of local_world_size={local_world_size}"
        )
    return tuple(r // local_world_size for r in range(world_size))
