"""The simulator with a host in front of each GPU: policies decide at *host* time, as the runtime does.

:func:`trainer.schedule.simulator.simulate` lets a stage decide when its GPU is idle, on the
outputs its neighbours' GPUs have finished: decisions at GPU time. The runtime differs in two ways
that matter once the host runs ahead of its GPU (CUDA graphs: one replay launch per op):

- an input counts as arrived when its **header** arrives, and the sender posts the header when it
  *queues* the producing op, long before that op has run on its GPU;
- the GPU runs the ops of a stage **in decision order** on one stream, each waiting for its input
  data on the GPU. A forward decided on an early header holds back every op behind it until its
  activation exists (head-of-line blocking), although a backward whose gradient is there could run.

Here each stage has a host clock and a GPU clock. A decision at host time ``h`` sees the headers
that arrived by ``h``; the op is queued (``h += launch``), runs on the GPU from
``max(GPU free, h, its input data on this GPU)`` for its drawn duration, posts its header at
``h + header_latency`` and its data at ``end + edge transfer``. ``max_queued_ops = K`` is the
runtime's ``--dpp-max-queued-ops``: the host decides only once at most K of its queued ops are
unfinished on the GPU (K = None: unbounded, the runtime's default). ``data_aware``: the host also
knows, when it decides, which arrived inputs have landed on its GPU (``StageState.grads_in_transit``,
``acts_in_transit``), as the runtime does for dpp-zb (``StageLinks.landed``: the transport looks at
the payload's GPU-side completion). Policies are the same objects
the runtime and the GPU-time simulator use. Static schedules are unaffected in their order (they
do not look at arrivals beyond readiness) but pay the same stream waits.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from trainer.schedule.backward_pool import PoolSpec
from trainer.schedule.core import Action, Op, PipelineShape, Policy, StageState
from trainer.schedule.costs import CostTable
from trainer.schedule.simulator import DeadlockError, OpRecord, SimResult, _describe_deadlock

_ACTIVATION, _GRADIENT, _WAKE = 0, 1, 2


def simulate_host_ahead(
    shape: PipelineShape, policies: Sequence[Policy], costs: CostTable, *, launch: float = 0.02,
    header_latency: float = 0.05, max_queued_ops: int | None = None, data_aware: bool = False,
    record: bool = False, pool: PoolSpec | None = None,
) -> SimResult:
    """One step of ``policies`` with host-time decisions (see the module docstring); time units as
    ``costs``. ``launch``: host time to queue one op; ``header_latency``: header's host-to-host
    delay; the edge transfer of ``costs`` is the data's GPU-to-GPU delay. ``pool``: price a graphed
    split backward's evacuations and early W's (trainer/schedule/backward_pool.py); None: free."""
    p = shape.num_stages
    _check(p, policies, launch, header_latency, max_queued_ops)
    states = [StageState(shape, s, split_backward=pol.split_backward, microbatch_costs=costs.microbatch_cost)
              for s, pol in enumerate(policies)]
    durations, edge = costs.durations, costs.edge_transfer
    pools = [pool.make() for _ in range(p)] if pool is not None else None
    host = [0.0] * p
    gpu_free = [0.0] * p
    ends: list[list[float]] = [[] for _ in range(p)]
    busy = [0.0] * p
    data_at: dict[tuple[int, int, int, int], float] = {}  # (stage, kind, m, c) -> data usable on its GPU
    wake_pending = [False] * p
    timeline: list[OpRecord] | None = [] if record else None
    events: list[tuple[float, int, int, int, int, int]] = []
    seq = 0

    def push(time: float, kind: int, stage: int, m: int = 0, c: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time, kind, seq, stage, m, c))

    def wake(stage: int, time: float) -> None:
        if not wake_pending[stage]:
            wake_pending[stage] = True
            push(max(time, host[stage]), _WAKE, stage)

    for s in range(p):
        wake(s, 0.0)
    while events:
        now, kind, _, s, m, c = heapq.heappop(events)
        state = states[s]
        if kind != _WAKE:  # a header: the input counts as arrived for the host from now on
            if kind == _ACTIVATION:
                state.mark_activation_arrived(m, c, landed=not data_aware or data_at[(s, _ACTIVATION, m, c)] <= now)
            else:
                state.mark_grad_arrived(m, c, landed=not data_aware or data_at[(s, _GRADIENT, m, c)] <= now)
            wake(s, now)
            continue
        wake_pending[s] = False
        t = max(now, host[s])
        queued = ends[s]
        if max_queued_ops is not None and len(queued) > max_queued_ops:
            bound = queued[len(queued) - 1 - max_queued_ops]  # one stream: ops finish in queue order
            if bound > t:
                wake_pending[s] = True
                push(bound, _WAKE, s)
                continue
        if data_aware:  # the runtime looks at its in-transit inputs before deciding
            _look_at_landing(state, s, t, data_at)
        action = policies[s].choose(state)
        if action is None:
            continue  # the next header for this stage wakes it
        state.mark_done(action)
        host[s] = t + launch
        start = max(gpu_free[s], host[s], _input_ready(s, action, data_at))
        duration = durations[action.op][s][action.chunk][action.microbatch]
        if pools is not None:  # an evacuation or an early W runs on the stream first
            before, duration = pools[s].run(action, lambda m_, c_, s=s: durations[Op.W][s][c_][m_], duration)
            busy[s] += before
            start += before
        end = start + duration
        gpu_free[s] = end
        queued.append(end)
        busy[s] += end - start
        if timeline is not None:
            timeline.append(OpRecord(s, action, start, end, state.inflight))
        _post(shape, s, action, host[s] + header_latency, end, edge, data_at, push)
        wake(s, host[s])
    stuck = [st for st in states if not st.finished]
    if stuck:
        raise DeadlockError(_describe_deadlock(policies, stuck))
    return SimResult(schedule=policies[0].name, shape=shape, step_time=max(gpu_free), busy=busy,
                     peak_inflight=[st.peak_inflight for st in states], timeline=timeline, edge_transfer=list(edge),
                     pool_counts=[pl.counts() for pl in pools] if pools is not None else None)


def _check(p: int, policies: Sequence[Policy], launch: float, header_latency: float,
           max_queued_ops: int | None) -> None:
    if len(policies) != p:
        raise ValueError(f"need one policy per stage: got {len(policies)} for num_stages={p}")
    if max_queued_ops is not None and max_queued_ops < 1:
        raise ValueError(f"max_queued_ops={max_queued_ops} must be >= 1 (or None: unbounded)")
    if launch < 0 or header_latency < 0:
        raise ValueError(f"launch={launch} and header_latency={header_latency} must be >= 0")


def _look_at_landing(state: StageState, stage: int, now: float, data_at: dict) -> None:
    """Mark the inputs whose data is on this stage's GPU by ``now`` as landed."""
    for key in [k for k in state.grads_in_transit if data_at[(stage, _GRADIENT, *k)] <= now]:
        state.mark_grad_landed(*key)
    for key in [k for k in state.acts_in_transit if data_at[(stage, _ACTIVATION, *k)] <= now]:
        state.mark_activation_landed(*key)


def _input_ready(stage: int, action: Action, data_at: dict) -> float:
    """When the neighbour's data ``action`` reads is on this stage's GPU (0: none). A W reads only
    its own I's output, queued earlier on the same stream, so ``gpu_free`` already orders it."""
    m, c = action.microbatch, action.chunk
    if action.op is Op.W:
        return 0.0
    kind = _ACTIVATION if action.op is Op.F else _GRADIENT
    return data_at.get((stage, kind, m, c), 0.0)


def _post(shape: PipelineShape, stage: int, action: Action, header_at: float, end: float, edge: list[float],
          data_at: dict, push) -> None:
    """Header to the consumer at ``header_at`` (host), data usable there at ``end`` + transfer (GPU)."""
    m, c = action.microbatch, action.chunk
    if action.op is Op.F:
        target = shape.downstream(stage, c)
        if target is not None:
            data_at[(target[0], _ACTIVATION, m, target[1])] = end + edge[stage]
            push(header_at, _ACTIVATION, target[0], m, target[1])
    elif action.op in (Op.B, Op.I):
        source = shape.upstream(stage, c)
        if source is not None:
            data_at[(source[0], _GRADIENT, m, source[1])] = end + edge[source[0]]
            push(header_at, _GRADIENT, source[0], m, source[1])
