"""Vocabulary shared by every schedule, the simulator and the real runtime (pure Python, no torch).

Stage ``s`` of ``p`` holds model chunks ``c`` of ``v``; chunk ``c`` of stage ``s`` is *virtual stage*
``c * p + s`` (Megatron-Core's interleaved layout), so a microbatch flows 0 -> 1 -> ... -> v*p - 1 and
activations wrap from stage p-1 back to stage 0 between chunks.

Actions: ``F(m, c)`` forward, ``B(m, c)`` full backward, or (split backward, zero-bubble style)
``I(m, c)`` input-gradient then ``W(m, c)`` weight-gradient.

A :class:`StageState` is what one stage knows: which actions ran, which inputs (activations from
upstream, gradients from downstream) have arrived. A :class:`Policy` maps that state to the next
action, or ``None`` (WAIT: nothing it is willing to run is ready). The same policy objects drive the
discrete-event simulator and the runtime, so what we simulate is what we run.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from trainer.problems import raise_if_any


class Op(str, enum.Enum):  # noqa: UP042 - keep str(Op.F) == "Op.F" as the contract had it
    F = "F"  # forward
    B = "B"  # full backward (input grad + weight grad)
    I = "I"  # input-gradient half of a split backward  # noqa: E741
    W = "W"  # weight-gradient half of a split backward


@dataclass(frozen=True, order=True)
class Action:
    op: Op
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        # Actions live in sets on the runtime's hot path: hash once, not per lookup (the
        # generated hash would rebuild a tuple and call Enum.__hash__, in Python, every time).
        object.__setattr__(self, "_hash", hash((self.op.value, self.microbatch, self.chunk)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __str__(self) -> str:  # "F3.c1" - also the trace event name
        return f"{self.op.value}{self.microbatch}.c{self.chunk}"


@dataclass(frozen=True)
class PipelineShape:
    """Sizes of one pipeline-parallel step."""

    num_stages: int
    """p: pipeline stages (ranks along the pipeline)."""
    num_microbatches: int
    """M: microbatches per step (per data-parallel replica)."""
    num_chunks: int = 1
    """v: model chunks per stage (virtual pipeline size)."""

    def __post_init__(self) -> None:
        bad = [
            f"{n}={getattr(self, n)}"
            for n in ("num_stages", "num_microbatches", "num_chunks")
            if getattr(self, n) < 1
        ]
        raise_if_any(bad, "pipeline sizes must be >= 1")

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.num_stages + stage

    def is_first_virtual(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == 0

    def is_last_virtual(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == self.num_virtual_stages - 1

    def downstream(self, stage: int, chunk: int) -> tuple[int, int] | None:
        """(stage, chunk) that consumes F(m, chunk)'s output, or None after the last virtual stage."""
        vs = self.virtual_stage(stage, chunk) + 1
        if vs >= self.num_virtual_stages:
            return None
        return vs % self.num_stages, vs // self.num_stages

    def upstream(self, stage: int, chunk: int) -> tuple[int, int] | None:
        """(stage, chunk) whose F feeds F(m, chunk) here, or None at virtual stage 0."""
        vs = self.virtual_stage(stage, chunk) - 1
        if vs < 0:
            return None
        return vs % self.num_stages, vs // self.num_stages


@dataclass
class StageState:
    """Everything one stage knows while running a step. Mutated only through its methods.

    Besides the public sets it keeps the *ready set* per op kind up to date on every event, so a
    policy's ``choose`` costs O(ready actions) rather than O(all actions): it runs once per op on
    the runtime's hot path.
    """

    shape: PipelineShape
    stage: int
    split_backward: bool = False
    """True when backwards run as I then W (zero-bubble policies), False for a single B."""
    done: set[Action] = field(default_factory=set)
    activations_arrived: set[tuple[int, int]] = field(default_factory=set)
    """(microbatch, chunk) whose input activation has arrived from upstream."""
    grads_arrived: set[tuple[int, int]] = field(default_factory=set)
    """(microbatch, chunk) whose output gradient has arrived from downstream."""
    grads_in_transit: set[tuple[int, int]] = field(default_factory=set)
    """The part of ``grads_arrived`` whose header is here but whose data, as far as this stage has
    looked, is not on its device yet (a host-time runtime learns of a gradient when the sender
    *queued* it; :meth:`mark_grad_landed` when it is there). Empty where arrival means the data is
    there (the GPU-time simulator, CPU runs)."""
    acts_in_transit: set[tuple[int, int]] = field(default_factory=set)
    """The same for ``activations_arrived``: header here, data (as far as this stage has looked)
    not yet on its device (:meth:`mark_activation_landed`)."""
    inflight: int = 0
    """Forwards whose activations are still held (F done, backward not finished)."""
    peak_inflight: int = 0
    inflight_per_chunk: list[int] = field(default_factory=list)
    """``inflight`` per chunk (filled in at construction): what a policy with per-chunk caps reads."""
    peak_inflight_per_chunk: list[int] = field(default_factory=list)
    """The most ``inflight_per_chunk`` reached, per chunk (since construction)."""
    reserved_forwards: int = 0
    """Forwards of later chunks still owed by microbatches whose chunk-0 forward ran here. A
    memory cap must keep room for them, or interleaved microbatches could starve each other."""
    microbatch_costs: tuple[float, ...] | None = None
    """Optional estimate of each microbatch's relative cost, known before its forward (e.g.
    ``(1 - a) r + a r^2`` from its sequence length ratio ``r``). Every stage of a step must get
    the same values: policies derive one microbatch order from them, and a stage that disagreed
    would wait for microbatches its neighbours have not started. None: all alike (the order is
    the microbatch index)."""
    _ready: dict[Op, set[Action]] = field(init=False, repr=False, compare=False)
    _done_keys: dict[Op, set[tuple[int, int]]] = field(init=False, repr=False, compare=False)
    """(microbatch, chunk) of the done actions, per op: cheaper to probe than building Actions."""
    _open: dict[int, list[int]] = field(init=False, repr=False, compare=False)
    """microbatch -> [forwards done here, activations held here], for microbatches that still
    owe a forward or hold an activation on this stage."""

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.shape.num_stages:
            raise ValueError(f"stage={self.stage} outside [0, {self.shape.num_stages})")
        if self.microbatch_costs is not None:
            self.microbatch_costs = tuple(float(x) for x in self.microbatch_costs)
            bad = [x for x in self.microbatch_costs if not (math.isfinite(x) and x > 0)]
            if len(self.microbatch_costs) != self.shape.num_microbatches or bad:
                raise ValueError(
                    f"microbatch_costs needs num_microbatches={self.shape.num_microbatches} finite"
                    f" values > 0: got {len(self.microbatch_costs)}"
                    + (f", bad values {bad[:4]}" if bad else ""))
        # Built once (from scratch only if the public sets came pre-filled); incremental afterwards.
        self._ready = {op: set() for op in Op}
        if self.done or self.activations_arrived or self.grads_arrived:
            for action in self.all_actions():
                if self.is_ready(action):
                    self._ready[action.op].add(action)
        elif self.stage == 0:  # a fresh step: only virtual stage 0's forwards need nothing
            self._ready[Op.F] = {Action(Op.F, m, 0) for m in range(self.shape.num_microbatches)}
        self._done_keys = {op: set() for op in Op}
        for action in self.done:
            self._done_keys[action.op].add((action.microbatch, action.chunk))
        self._open = {}
        self.inflight_per_chunk = [0] * self.shape.num_chunks
        release = Op.W if self.split_backward else Op.B
        for action in self.done:
            if action.op in (Op.F, release):
                entry = self._open.setdefault(action.microbatch, [0, 0])
                entry[0] += action.op is Op.F
                entry[1] += 1 if action.op is Op.F else -1
                self.inflight_per_chunk[action.chunk] += 1 if action.op is Op.F else -1
        self.peak_inflight_per_chunk = list(self.inflight_per_chunk)
        self._open = {m: e for m, e in self._open.items()
                      if e[0] < self.shape.num_chunks or e[1] > 0}
        if self.done:
            self.reserved_forwards = sum(self.shape.num_chunks - e[0] for e in self._open.values())

    @property
    def backward_op(self) -> Op:
        """The op that consumes a downstream gradient: I for a split backward, else B."""
        return Op.I if self.split_backward else Op.B

    # ---- events ------------------------------------------------------------------------------
    def mark_activation_arrived(self, microbatch: int, chunk: int, landed: bool = True) -> None:
        """The activation's header is here; ``landed=False``: its data is still on the way."""
        self.activations_arrived.add((microbatch, chunk))
        if not landed:
            self.acts_in_transit.add((microbatch, chunk))
        if (microbatch, chunk) not in self._done_keys[Op.F]:
            self._ready[Op.F].add(Action(Op.F, microbatch, chunk))

    def mark_grad_arrived(self, microbatch: int, chunk: int, landed: bool = True) -> None:
        """The gradient's header is here; ``landed=False``: its data is still on the way."""
        self.grads_arrived.add((microbatch, chunk))
        if not landed:
            self.grads_in_transit.add((microbatch, chunk))
        self._refresh_backward(microbatch, chunk)

    def mark_grad_landed(self, microbatch: int, chunk: int) -> None:
        self.grads_in_transit.discard((microbatch, chunk))

    def mark_activation_landed(self, microbatch: int, chunk: int) -> None:
        self.acts_in_transit.discard((microbatch, chunk))

    def mark_done(self, action: Action) -> None:
        assert action not in self.done, f"stage {self.stage}: {action} ran twice"
        # The ready set is kept equal to is_ready() (tests check it): an O(1) readiness check.
        assert action in self._ready[action.op], f"stage {self.stage}: {action} ran before its inputs"
        self.done.add(action)
        self._ready[action.op].discard(action)
        m, c = action.microbatch, action.chunk
        self._done_keys[action.op].add((m, c))
        if action.op is Op.F:
            self.acts_in_transit.discard((m, c))
            self.inflight += 1
            self.inflight_per_chunk[c] += 1
            self.peak_inflight_per_chunk[c] = max(self.peak_inflight_per_chunk[c], self.inflight_per_chunk[c])
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            self.reserved_forwards += self.shape.num_chunks - 1 if c == 0 else -1
            entry = self._open.setdefault(m, [0, 0])
            entry[0] += 1
            entry[1] += 1
            self._refresh_backward(m, c)
        elif action.op is Op.I:
            self.grads_in_transit.discard((m, c))
            self._ready[Op.W].add(Action(Op.W, m, c))
        else:
            self.grads_in_transit.discard((m, c))  # B (W: already gone with its I)
            # Activations are released when the whole backward of (m, c) has run: for a split
            # backward W still reads the saved inputs, so they are held until W.
            self.inflight -= 1
            self.inflight_per_chunk[c] -= 1
            entry = self._open[m]
            entry[1] -= 1
            if entry[1] == 0 and entry[0] == self.shape.num_chunks:
                del self._open[m]

    def _refresh_backward(self, microbatch: int, chunk: int) -> None:
        """Add the backward of (microbatch, chunk) to the ready set if its forward ran and its
        gradient is here (is_ready's rule, without re-deriving the parts known to hold)."""
        key, op = (microbatch, chunk), self.backward_op
        if key in self._done_keys[op] or key not in self._done_keys[Op.F]:
            return
        if key in self.grads_arrived or self.shape.is_last_virtual(self.stage, chunk):
            self._ready[op].add(Action(op, microbatch, chunk))

    # ---- queries -----------------------------------------------------------------------------
    def is_ready(self, action: Action) -> bool:
        """True when ``action``'s inputs are present and it has not run yet."""
        if action in self.done:
            return False
        m, c, s, shape = action.microbatch, action.chunk, self.stage, self.shape
        if action.op is Op.F:
            return shape.is_first_virtual(s, c) or (m, c) in self.activations_arrived
        if action.op is Op.W:
            return Action(Op.I, m, c) in self.done
        if (action.op is Op.B) == self.split_backward:
            return False  # B only without split, I only with split
        if Action(Op.F, m, c) not in self.done:
            return False
        return shape.is_last_virtual(s, c) or (m, c) in self.grads_arrived

    def done_count(self, op: Op) -> int:
        """How many actions of one kind have run on this stage (O(1))."""
        return len(self._done_keys[op])

    def ready_of(self, op: Op) -> AbstractSet[Action]:
        """The ready actions of one kind (a live view: do not mutate, copy before iterating
        across events)."""
        return self._ready[op]

    def open_microbatches(self) -> dict[int, list[int]]:
        """microbatch -> [forwards done here, activations held here] for every microbatch that
        still owes this stage a forward or holds an activation here (a live view: do not mutate).
        Memory-capped policies use it to check that every started microbatch can still finish."""
        return self._open

    def all_actions(self) -> list[Action]:
        ops = (Op.F, Op.I, Op.W) if self.split_backward else (Op.F, Op.B)
        return [
            Action(op, m, c)
            for op in ops
            for c in range(self.shape.num_chunks)
            for m in range(self.shape.num_microbatches)
        ]

    def ready_actions(self) -> list[Action]:
        """Ready actions, oldest microbatch first within each kind."""
        ready = [a for actions in self._ready.values() for a in actions]
        return sorted(ready, key=lambda a: (a.op.value, a.microbatch, a.chunk))

    @property
    def total_actions(self) -> int:
        per = 3 if self.split_backward else 2
        return per * self.shape.num_microbatches * self.shape.num_chunks

    @property
    def finished(self) -> bool:
        return len(self.done) == self.total_actions


@runtime_checkable
class Policy(Protocol):
    """Chooses a stage's next action. Pure: reads ``state``, never mutates it, does no I/O."""

    name: str
    split_backward: bool

    def choose(self, state: StageState) -> Action | None:
        """The next action to run, or None to wait for an arrival."""
        ...


def cost_order(costs: tuple[float, ...] | None, num_microbatches: int) -> list[int]:
    """The order in which to start microbatches given their estimated relative ``costs``.

    Cheapest first, rising to the dearest in the middle and falling again to the second
    cheapest last (a "pyramid"): the pipeline fills behind the first microbatch's forward and
    drains behind the last one's backward, so both ends want short ones; in between, neighbours of
    similar length keep the stages in step (a long microbatch after a short one leaves the next
    stage idle under any order of ops). Measured against the index order and against sorted
    orders in docs/schedules.md. No costs, or all equal: the index order.
    """
    if costs is None or len(set(costs)) <= 1:
        return list(range(num_microbatches))
    ascending = sorted(range(num_microbatches), key=lambda m: (costs[m], m))
    return ascending[0::2] + ascending[1::2][::-1]
