"""The dynamic (greedy) pipeline policies: ``dpp`` and its split-backward variant ``dpp-zb``.

Each call looks only at what is ready *now* on this stage and picks:

* a **forward**, if the in-flight activation cap allows it (chunk-0 forwards admit a new
  microbatch and must leave room for the later-chunk forwards it will owe, see
  :attr:`StageState.reserved_forwards`; without that reservation interleaved microbatches can
  fill the cap with chunk-0 activations and deadlock waiting for chunk-1 slots);
* a **backward** (B, or its input-gradient half I), which is on the critical path of the stages
  upstream and frees memory;
* for ``dpp-zb`` a deferred **weight gradient** W: nobody waits for it, so it fills idle time
  and runs early only when it frees the memory a ready forward needs.

``priority`` orders forward vs backward; ``chunk_order`` picks depth-first (finish a microbatch's
later chunks first: less memory, earlier gradients) or breadth-first (feed chunk 0 first: fill
the pipeline sooner). Within a kind the oldest microbatch goes first. A policy is pure: it reads
the state and returns an action or ``None`` (wait for an arrival).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.schedule.core import Action, Op, PipelineShape, StageState
from trainer.schedule.static import interleaved_warmup

PRIORITIES = ("forward", "backward")
CHUNK_ORDERS = ("depth", "breadth")


def one_f_one_b_cap(shape: PipelineShape, stage: int) -> int:
    """In-flight activations (in chunk units) that Megatron-Core's schedule holds at most on
    ``stage``: ``p - s`` for 1F1B, the interleaved warm-up count + 1 for ``v > 1``."""
    if shape.num_chunks == 1:
        return min(shape.num_stages - stage, shape.num_microbatches)
    return min(interleaved_warmup(shape, stage) + 1, shape.num_microbatches * shape.num_chunks)


@dataclass(frozen=True)
class DynamicOptions:
    """Knobs of the greedy policy (``make_policy(name, shape, stage, **options)``)."""

    max_inflight: int | None = None
    """Cap on activations held (chunk units, F done and B/W not yet). None: ``cap_factor`` x
    1F1B's bound for this stage (:func:`one_f_one_b_cap`)."""
    cap_factor: float = 1.0
    """Multiplier on 1F1B's bound when ``max_inflight`` is None (rounded down)."""
    priority: str = "forward"
    """"forward": a ready forward under the cap beats a ready backward; "backward": the reverse."""
    chunk_order: str = "depth"
    """"depth": later chunks first for forwards, earlier chunks first for backwards;
    "breadth": the opposite."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_inflight is not None and self.max_inflight < 1:
            problems.append(f"max_inflight={self.max_inflight} must be >= 1")
        if not (isinstance(self.cap_factor, int | float) and math.isfinite(self.cap_factor)
                and self.cap_factor >= 1.0):
            problems.append(f"cap_factor={self.cap_factor!r} must be a finite number >= 1")
        if self.priority not in PRIORITIES:
            problems.append(f"priority={self.priority!r} not in {PRIORITIES}")
        if self.chunk_order not in CHUNK_ORDERS:
            problems.append(f"chunk_order={self.chunk_order!r} not in {CHUNK_ORDERS}")
        if problems:
            raise ValueError("invalid dynamic schedule options: " + "; ".join(problems))

    def resolve_cap(self, shape: PipelineShape, stage: int) -> int:
        """The cap this stage runs with; at least ``v`` so one microbatch can pass every chunk."""
        if self.max_inflight is not None:
            cap = self.max_inflight
        else:
            cap = math.floor(self.cap_factor * one_f_one_b_cap(shape, stage) + 1e-9)
        if cap < shape.num_chunks:
            raise ValueError(
                f"stage {stage}: max_inflight={cap} < num_chunks={shape.num_chunks}: a microbatch "
                "needs one activation slot per chunk on every stage"
            )
        return cap


class DynamicPolicy:
    """Greedy policy over the ready set; ``split_backward`` turns ``dpp`` into ``dpp-zb``."""

    def __init__(
        self, name: str, shape: PipelineShape, stage: int, options: DynamicOptions,
        split_backward: bool,
    ) -> None:
        self.name = name
        self.split_backward = split_backward
        self.options = options
        self.cap = options.resolve_cap(shape, stage)
        self._num_chunks = shape.num_chunks
        # Sort keys: smaller wins. Depth-first forwards favour later chunks, depth-first
        # backwards favour earlier chunks (both move a started microbatch towards completion).
        depth = options.chunk_order == "depth"
        self._forward_key = (lambda a: (-a.chunk, a.microbatch)) if depth else (
            lambda a: (a.chunk, a.microbatch))
        self._backward_key = (lambda a: (a.chunk, a.microbatch)) if depth else (
            lambda a: (-a.chunk, a.microbatch))
        self._forward_first = options.priority == "forward"

    def __repr__(self) -> str:
        return f"DynamicPolicy({self.name!r}, cap={self.cap}, {self.options})"

    def _admissible_forward(self, state: StageState) -> Action | None:
        """Best ready forward the memory cap allows, or None."""
        ready = state.ready_of(Op.F)
        if not ready:
            return None
        room = self.cap - state.inflight
        if room <= 0:
            return None
        # A chunk-0 forward admits a new microbatch: it needs its own slot plus one for each of
        # its later chunks, on top of the slots already owed to admitted microbatches.
        can_admit = room - state.reserved_forwards >= self._num_chunks
        candidates = ready if can_admit else [a for a in ready if a.chunk > 0]
        return min(candidates, key=self._forward_key, default=None)

    def choose(self, state: StageState) -> Action | None:
        backward_ready = state.ready_of(state.backward_op)
        backward = min(backward_ready, key=self._backward_key) if backward_ready else None
        if backward is not None and not self._forward_first:
            return backward
        forward = self._admissible_forward(state)
        if forward is not None:
            return forward
        if backward is not None:
            return backward
        if self.split_backward:
            weight_ready = state.ready_of(Op.W)
            if weight_ready:  # nothing urgent is ready: fill the idle time with deferred W
                return min(weight_ready, key=self._backward_key)
        return None
