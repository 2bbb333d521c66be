"""Discrete-event simulator: one policy object per stage, driven exactly as the runtime drives them.

Every stage is one compute resource. When it is idle it asks its policy for an action; an action
occupies it for the action's drawn duration; a finished forward sends its activation downstream
and a finished backward (B or I) sends its gradient upstream, each arriving after the transfer
time of the edge it crosses.
Arrivals and completions at the same instant are all applied before any stage decides, so a
policy sees everything that has happened "by now" (as the runtime's drain-then-choose loop does).

A run that ends with unfinished stages is a deadlock and raises :class:`DeadlockError` naming each
stuck stage and what it has left, never returns a silently short result.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer.schedule.core import Action, Op, PipelineShape, Policy, StageState
from trainer.schedule.costs import CostTable

# Event kinds, in the order they are applied at one instant (heap tie-break).
_ACTIVATION, _GRADIENT, _COMPLETE, _DECIDE = 0, 1, 2, 3


class DeadlockError(RuntimeError):
    """The simulated step stopped with work left: every unfinished stage waits forever."""


@dataclass(frozen=True)
class OpRecord:
    """One executed action on the simulated timeline."""

    stage: int
    action: Action
    start: float
    end: float
    inflight: int
    """Activations held on the stage after the action."""


@dataclass
class SimResult:
    """What one simulated step did."""

    schedule: str
    shape: PipelineShape
    step_time: float
    """Time at which the last stage finished its last action."""
    busy: list[float]
    """Compute time of each stage."""
    peak_inflight: list[int]
    """Peak activations held per stage, in chunk units (one chunk = 1/v of a stage)."""
    peak_inflight_per_chunk: list[tuple[int, ...]] = field(default_factory=list)
    """Per stage, the peak held in each of its chunks."""
    timeline: list[OpRecord] | None = None
    """Every executed action, when the run was asked to record them."""
    edge_transfer: list[float] | None = None
    """Transfer time of each edge s -> s+1 (mod p) the run used."""
    pool_counts: list[tuple[int, int, int]] | None = None
    """Host-time model with the backward pool priced: per stage (W's read in place, evacuations, early W's)."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time over the step: 1 - sum(busy) / (p * step_time)."""
        return 1.0 - sum(self.busy) / (self.shape.num_stages * self.step_time)

    @property
    def peak_activations(self) -> float:
        """Largest per-stage peak in units of one microbatch's whole-stage activations (so v=1
        and v=2 schedules compare directly)."""
        return max(self.peak_inflight) / self.shape.num_chunks


def simulate(
    shape: PipelineShape, policies: Sequence[Policy], costs: CostTable, record: bool = False,
) -> SimResult:
    """Run one step of ``policies`` (one per stage) on the op durations ``costs``."""
    p = shape.num_stages
    if len(policies) != p:
        raise ValueError(f"need one policy per stage: got {len(policies)} for num_stages={p}")
    # What the runtime can know before a forward (sequence lengths), never the drawn durations.
    hints = costs.microbatch_cost
    states = [StageState(shape, s, split_backward=pol.split_backward, microbatch_costs=hints)
              for s, pol in enumerate(policies)]
    durations, edge_transfer = costs.durations, costs.edge_transfer
    busy = [0.0] * p
    running = [False] * p
    decide_pending = [False] * p
    timeline: list[OpRecord] | None = [] if record else None
    events: list[tuple[float, int, int, int, int, int]] = []  # (time, kind, seq, stage, m, c)
    seq = 0
    finish = 0.0

    def push(time: float, kind: int, stage: int, m: int = 0, c: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time, kind, seq, stage, m, c))

    for s in range(p):
        push(0.0, _DECIDE, s)
        decide_pending[s] = True
    running_action: list[Action | None] = [None] * p
    started_at = [0.0] * p

    while events:
        now, kind, _, s, m, c = heapq.heappop(events)
        state = states[s]
        if kind == _ACTIVATION:
            state.mark_activation_arrived(m, c)
        elif kind == _GRADIENT:
            state.mark_grad_arrived(m, c)
        elif kind == _COMPLETE:
            action = running_action[s]
            state.mark_done(action)
            running[s] = False
            busy[s] += now - started_at[s]
            finish = max(finish, now)
            if timeline is not None:
                timeline.append(OpRecord(s, action, started_at[s], now, state.inflight))
            _send_outputs(shape, s, action, now, edge_transfer, push)
        else:  # _DECIDE
            decide_pending[s] = False
            if running[s]:
                continue
            action = policies[s].choose(state)
            if action is None:
                continue  # wait: the next arrival for this stage schedules a new decision
            running[s], running_action[s], started_at[s] = True, action, now
            op = action.op
            push(now + durations[op][s][action.chunk][action.microbatch], _COMPLETE, s)
            continue
        if not running[s] and not decide_pending[s]:
            decide_pending[s] = True
            push(now, _DECIDE, s)

    stuck = [st for st in states if not st.finished]
    if stuck:
        raise DeadlockError(_describe_deadlock(policies, stuck))
    return SimResult(
        schedule=policies[0].name, shape=shape, step_time=finish, busy=busy,
        peak_inflight=[st.peak_inflight for st in states], timeline=timeline,
        peak_inflight_per_chunk=[tuple(st.peak_inflight_per_chunk) for st in states],
        edge_transfer=list(edge_transfer),
    )


def _send_outputs(shape: PipelineShape, stage: int, action: Action, now: float,
                  edge_transfer: list[float], push) -> None:
    """Schedule the arrival of what ``action`` produced at the stage that consumes it."""
    m, c = action.microbatch, action.chunk
    if action.op is Op.F:
        target = shape.downstream(stage, c)
        if target is not None:
            push(now + edge_transfer[stage], _ACTIVATION, target[0], m, target[1])
    elif action.op in (Op.B, Op.I):
        source = shape.upstream(stage, c)
        if source is not None:  # the gradient crosses the edge source -> stage backwards
            push(now + edge_transfer[source[0]], _GRADIENT, source[0], m, source[1])


def _describe_deadlock(policies: Sequence[Policy], stuck: list[StageState]) -> str:
    lines = []
    for st in stuck:
        ready = ", ".join(map(str, st.ready_actions()[:6])) or "nothing"
        lines.append(
            f"stage {st.stage} ({policies[st.stage]!r}): {len(st.done)}/{st.total_actions} done,"
            f" {st.inflight} activations held, ready but refused: {ready}"
        )
    return "simulated step deadlocked:\n  " + "\n  ".join(lines)
