"""What a graphed split backward pays around the stage's shared backward pool, for the host-time model.

The runtime (trainer/pipeline/graph_operands.py) leaves a slot's W operands in the stage's backward pool
after its I. Before any other backward graph of the stage replays (an I or B, or another slot's W), it
evacuates them into a free one of the buffer sets the stage's slots share -- a copy -- or, with every
set taken, replays that slot's W at once and its W in the schedule's order later does nothing. A W that
directly follows its own I reads the pool (no copy). :class:`PoolState` decides all that, for the runtime
(which replays what it decides: graph_operands.BackwardPoolState) and for the model alike;
:class:`BackwardPoolModel` adds the GPU time each case costs in the host-time model: an evacuation ``copy`` times the slot's W time (the copy reads
and writes the operands the W GEMMs read once), an early W its whole W time, moved ahead of the op that
needed the pool. ``copy`` 0.06 is measured: on 2xH200 (gpt16-h2048, PP=2, local layers) copying inside
every I added 8 ms per iteration to a 7.5-layer stage's GPU busy time (681 against 673 ms), 0.033 ms per
layer and microbatch, where a layer's W takes about 0.555 ms. Pure: no torch, no time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from trainer.schedule.core import Action, Op

MEASURED_COPY = 0.06
"""An evacuation's GPU time as a share of the slot's W time (module docstring)."""


EARLY, DIRECT = "early", "direct"
"""What :meth:`PoolState.weight` says a W does besides reading a set: nothing (it ran early), or read the pool."""


@dataclass(frozen=True)
class Move:
    """The pool's holder leaving it before another backward: evacuated ``into`` a set, or (None) its W runs now."""

    key: Hashable
    into: Hashable | None


class PoolState:
    """One stage's backward pool and evacuation sets, for the runtime and the model alike: which slot's W
    operands lie in the pool (the holder), which set holds whose, whose W ran early. Keys are the callers'
    slot ids; ``usable(key)`` lists the set ids a slot may evacuate into, in order of preference (the shared
    sets; or one of the slot's own)."""

    def __init__(self, usable: Callable[[Hashable], Sequence[Hashable]]) -> None:
        self.usable = usable
        self.holder: Hashable | None = None
        self.occupant: dict[Hashable, Hashable] = {}
        """Set id -> the slot whose operands it holds until that slot's W."""
        self.in_set: dict[Hashable, Hashable] = {}
        self.done_early: set[Hashable] = set()
        self.direct = self.evacuated = self.early = 0

    def backward(self, key: Hashable | None = None) -> Move | None:
        """Another backward (``key``'s, if given) is about to run: how the holder leaves the pool, if one
        does (into the first free set it may use; with none free, its W runs now)."""
        holder = self.holder
        if holder is None or holder == key:
            return None
        self.holder = None
        free = next((k for k in self.usable(holder) if k not in self.occupant), None)
        if free is None:
            self.done_early.add(holder)
            self.early += 1
            return Move(holder, None)
        self.occupant[free], self.in_set[holder] = holder, free
        self.evacuated += 1
        return Move(holder, free)

    def after_i(self, key: Hashable, leaves_operands: bool) -> None:
        """``key``'s I ran: its W operands lie in the pool (if it leaves any) until the next backward."""
        self.holder = key if leaves_operands else None

    def weight(self, key: Hashable) -> tuple[Move | None, Hashable]:
        """``key``'s W in the schedule's order: (how the holder leaves the pool first, or None; then
        :data:`EARLY` -- nothing to run --, :data:`DIRECT` -- read the pool -- or the set id to read)."""
        if key in self.done_early:
            self.done_early.discard(key)
            return None, EARLY
        if self.holder == key:
            self.holder = None
            self.direct += 1
            return None, DIRECT
        index = self.in_set.get(key)
        if index is None or self.occupant.get(index) != key:
            raise RuntimeError("split backward with CUDA graphs: a W whose operands are neither in the backward pool "
                               "nor in an evacuation set (its I did not run since its last W)")
        move = self.backward(key)  # the W works in the pool: the holder leaves first, while this set is taken
        del self.occupant[index], self.in_set[key]
        return move, index

    def counts(self) -> tuple[int, int, int]:
        """(W's read in place, evacuations, W's run early)."""
        return self.direct, self.evacuated, self.early


@dataclass(frozen=True)
class PoolSpec:
    """How the host-time model prices the backward pool (``--evacuation-sets``, ``--evacuation-copy``)."""

    sets: int | None
    """Evacuation sets per stage; None: a set per slot."""
    copy: float = MEASURED_COPY

    def make(self) -> BackwardPoolModel:
        return BackwardPoolModel(self.sets, self.copy)


class BackwardPoolModel:
    """One stage's pool in the host-time model: :class:`PoolState` with slots keyed (microbatch, chunk)
    and the GPU time of each move (module docstring)."""

    def __init__(self, sets: int | None, copy: float = MEASURED_COPY) -> None:
        if sets is not None and sets < 1:
            raise ValueError(f"evacuation sets: {sets}; at least one (or None: a set per slot)")
        if copy < 0:
            raise ValueError(f"evacuation copy share {copy} must be >= 0")
        shared = tuple(range(sets)) if sets is not None else None
        self.copy = copy
        self.state = PoolState(lambda key: shared if shared is not None else (("own", key),))

    def run(self, action: Action, w_time: Callable[[int, int], float], duration: float) -> tuple[float, float]:
        """``action`` is about to run on the stage's GPU (its own ``duration``): (GPU time before it -- an
        evacuation or an early W --, the action's own time: 0 for a W that already ran)."""
        key = (action.microbatch, action.chunk)
        if action.op is Op.F:
            return 0.0, duration
        if action.op is Op.W:
            move, reads = self.state.weight(key)
            return self._cost(move, w_time), 0.0 if reads == EARLY else duration
        before = self._cost(self.state.backward(key), w_time)
        if action.op is Op.I:
            self.state.after_i(key, True)
        return before, duration

    def _cost(self, move: Move | None, w_time: Callable[[int, int], float]) -> float:
        if move is None:
            return 0.0
        return w_time(*move.key) * (1.0 if move.into is None else self.copy)

    def counts(self) -> tuple[int, int, int]:
        return self.state.counts()
