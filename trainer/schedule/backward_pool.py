"""What a graphed split backward pays around the stage's shared backward pool, for the host-time model.

The runtime (trainer/pipeline/graph_operands.py) leaves a slot's W operands in the stage's backward pool
after its I. Before any other backward graph of the stage replays (an I or B, or another slot's W), it
evacuates them into a free one of the buffer sets the stage's slots share -- a copy -- or, with every
set taken, replays that slot's W at once and its W in the schedule's order later does nothing. A W that
directly follows its own I reads the pool (no copy). :class:`BackwardPoolModel` is that state machine per
stage with the GPU time each case costs: an evacuation ``copy`` times the slot's W time (the copy reads
and writes the operands the W GEMMs read once), an early W its whole W time, moved ahead of the op that
needed the pool. ``copy`` 0.06 is measured: on 2xH200 (gpt16-h2048, PP=2, local layers) copying inside
every I added 8 ms per iteration to a 7.5-layer stage's GPU busy time (681 against 673 ms), 0.033 ms per
layer and microbatch, where a layer's W takes about 0.555 ms. Pure: no torch, no time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.schedule.core import Action, Op

MEASURED_COPY = 0.06
"""An evacuation's GPU time as a share of the slot's W time (module docstring)."""


@dataclass(frozen=True)
class PoolSpec:
    """How the host-time model prices the backward pool (``--evacuation-sets``, ``--evacuation-copy``)."""

    sets: int | None
    """Evacuation sets per stage; None: a set per slot."""
    copy: float = MEASURED_COPY

    def make(self) -> BackwardPoolModel:
        return BackwardPoolModel(self.sets, self.copy)


@dataclass
class BackwardPoolModel:
    """One stage's backward pool: which slot (microbatch, chunk) holds it, which sets hold whose operands."""

    sets: int | None
    """Evacuation sets the stage's slots share; None: a set per slot (never all taken)."""
    copy: float = MEASURED_COPY
    holder: tuple[int, int] | None = None
    held: set[tuple[int, int]] = field(default_factory=set)
    """Slots whose operands an evacuation set holds until their W."""
    done_early: set[tuple[int, int]] = field(default_factory=set)
    direct: int = 0
    evacuated: int = 0
    early: int = 0

    def __post_init__(self) -> None:
        if self.sets is not None and self.sets < 1:
            raise ValueError(f"evacuation sets: {self.sets}; at least one (or None: a set per slot)")
        if self.copy < 0:
            raise ValueError(f"evacuation copy share {self.copy} must be >= 0")

    def run(self, action: Action, w_time: Callable[[int, int], float], duration: float) -> tuple[float, float]:
        """``action`` is about to run on the stage's GPU (its own ``duration``): (GPU time before it -- an
        evacuation or an early W --, the action's own time: 0 for a W that already ran)."""
        key = (action.microbatch, action.chunk)
        if action.op is Op.F:
            return 0.0, duration
        if action.op is Op.W and key in self.done_early:
            self.done_early.discard(key)
            return 0.0, 0.0
        if action.op is Op.W and self.holder == key:
            self.holder = None
            self.direct += 1
            return 0.0, duration
        before = self._clear(w_time)
        if action.op is Op.W:
            self.held.discard(key)
        elif action.op is Op.I:
            self.holder = key
        return before, duration

    def _clear(self, w_time: Callable[[int, int], float]) -> float:
        """Another backward replays: the holder's operands leave the pool; their GPU time."""
        holder, self.holder = self.holder, None
        if holder is None:
            return 0.0
        if self.sets is None or len(self.held) < self.sets:
            self.held.add(holder)
            self.evacuated += 1
            return self.copy * w_time(*holder)
        self.done_early.add(holder)
        self.early += 1
        return w_time(*holder)

    def counts(self) -> tuple[int, int, int]:
        """(W's read in place, evacuations, W's run early)."""
        return self.direct, self.evacuated, self.early
