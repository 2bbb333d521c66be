"""Static pipeline schedules (GPipe, 1F1B, Megatron-Core's interleaved 1F1B, ZB-H1) as action lists.

A static schedule is one fixed order of actions per stage. Wrapped in :class:`StaticPolicy` it
answers ``choose`` with the next listed action when that action is ready, else ``None`` (wait):
it never reorders, exactly like the hand-written loops of Megatron-Core. Expressing them as
policies lets the simulator compare them with the dynamic ones on the same cost model.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.problems import raise_if_any
from trainer.schedule.core import Action, Op, PipelineShape, StageState, cost_order


class StaticPolicy:
    """Runs ``order`` as written. Pure: the position in the list is ``len(state.done)``."""

    def __init__(self, name: str, order: Sequence[Action], split_backward: bool = False,
                 microbatch_order: str = "index") -> None:
        if microbatch_order not in ("index", "cost"):
            raise ValueError(f"microbatch_order={microbatch_order!r} not in ('index', 'cost')")
        self.name = name
        self.split_backward = split_backward
        self.order: tuple[Action, ...] = tuple(order)
        self.microbatch_order = microbatch_order
        """"index": Megatron's order. "cost": the list's k-th microbatch is the k-th of
        ``cost_order(state.microbatch_costs)`` - the static schedule over a data loader that
        sorted the step's microbatches the way the dynamic policies order them (a baseline that
        separates what reordering buys from what dynamic decisions buy)."""
        self._relabel_for: object = ()
        self._relabel: list[int] | None = None

    def choose(self, state: StageState) -> Action | None:
        position = len(state.done)
        if position >= len(self.order):
            return None
        action = self.order[position]
        if self.microbatch_order == "cost" and state.microbatch_costs is not None:
            if state.microbatch_costs is not self._relabel_for:
                self._relabel_for = state.microbatch_costs
                self._relabel = cost_order(state.microbatch_costs, state.shape.num_microbatches)
            action = Action(action.op, self._relabel[action.microbatch], action.chunk)
        return action if state.is_ready(action) else None

    def __repr__(self) -> str:
        return f"StaticPolicy({self.name!r}, {len(self.order)} actions)"

    def held_per_chunk(self, num_chunks: int) -> tuple[int, ...]:
        """Most activations the order holds at once per chunk (:func:`peak_held_per_chunk`): how many
        CUDA graph slots each chunk needs so that no forward of the order runs eagerly."""
        return peak_held_per_chunk(self.order, num_chunks, self.split_backward)


def peak_held_per_chunk(order: Sequence[Action], num_chunks: int, split_backward: bool) -> tuple[int, ...]:
    """Per chunk, the most activations ``order`` holds at once: F takes one, the action that ends the
    microbatch's backward there gives it back (B; W for a split backward, which still reads the
    saved inputs). A static order fixes this number, where a dynamic policy is bounded by its cap:
    ZB-H1 holds ``p`` on every stage (1F1B: ``p - s``), interleaved 1F1B its warm-up count + 1 over
    both chunks together, split unevenly between them."""
    release = Op.W if split_backward else Op.B
    held, peak = [0] * num_chunks, [0] * num_chunks
    for action in order:
        if action.op is Op.F:
            held[action.chunk] += 1
            peak[action.chunk] = max(peak[action.chunk], held[action.chunk])
        elif action.op is release:
            held[action.chunk] -= 1
    return tuple(peak)


def gpipe_order(shape: PipelineShape, stage: int) -> list[Action]:
    """All forwards (chunk by chunk, oldest microbatch first), then all backwards in reverse chunk
    order. Holds every microbatch's activations: the memory-hungry baseline."""
    m_range = range(shape.num_microbatches)
    forwards = [Action(Op.F, m, c) for c in range(shape.num_chunks) for m in m_range]
    backwards = [Action(Op.B, m, c) for c in reversed(range(shape.num_chunks)) for m in m_range]
    return forwards + backwards


def one_f_one_b_order(shape: PipelineShape, stage: int) -> list[Action]:
    """Megatron-Core's non-interleaved 1F1B: ``p - s - 1`` warm-up forwards, then one forward and
    one backward in turn, then the cool-down backwards. At most ``p - s`` activations held."""
    if shape.num_chunks != 1:
        raise ValueError(
            f"1f1b runs one model chunk per stage, got num_chunks={shape.num_chunks}: use 'interleaved'"
        )
    m_count = shape.num_microbatches
    warmup = min(shape.num_stages - stage - 1, m_count)
    order = [Action(Op.F, m) for m in range(warmup)]
    for k in range(m_count - warmup):
        order += [Action(Op.F, k + warmup), Action(Op.B, k)]
    order += [Action(Op.B, k) for k in range(m_count - warmup, m_count)]
    return order


def megatron_schedule_table(
    num_microbatches: int, num_chunks: int, group_size: int
) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each virtual microbatch, as Megatron-Core's ``get_schedule_table``:
    groups of ``group_size`` microbatches run through chunk 0, then chunk 1, ...; the last group
    takes whatever microbatches are left."""
    table: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, group_size):
        last = num_microbatches if first + group_size >= num_microbatches else first + group_size
        table += [(m, c) for c in range(num_chunks) for m in range(first, last)]
    return table


def interleaved_warmup(shape: PipelineShape, stage: int, group_size: int | None = None) -> int:
    """Megatron-Core's warm-up forward count for interleaved 1F1B (``get_pp_rank_microbatches``)."""
    group = shape.num_stages if group_size is None else group_size
    warmup = (shape.num_stages - stage - 1) * 2 + (shape.num_chunks - 1) * group
    return min(warmup, shape.num_microbatches * shape.num_chunks)


def interleaved_order(
    shape: PipelineShape, stage: int, group_size: int | None = None
) -> list[Action]:
    """Megatron-Core's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``).

    ``group_size`` is Megatron's ``microbatch_group_size_per_vp_stage`` (default ``p``). Megatron
    rejects groups outside ``[p, M]`` and a last partial group smaller than ``p``; so do we, with
    the same reasons, because its order then stalls on dependencies."""
    p, m_count, v = shape.num_stages, shape.num_microbatches, shape.num_chunks
    group = p if group_size is None else group_size
    problems = []
    if not p <= group <= m_count:
        problems.append(f"group_size={group} must lie in [num_stages={p}, num_microbatches={m_count}]")
    elif 0 < m_count % group < p:
        problems.append(
            f"num_microbatches={m_count} leaves a last group of {m_count % group} < num_stages={p}"
            f" (group_size={group}); Megatron-Core refuses this too"
        )
    raise_if_any(problems, "interleaved 1F1B")
    table = megatron_schedule_table(m_count, v, group)
    total = len(table)
    warmup = interleaved_warmup(shape, stage, group)

    def forward(k: int) -> Action:
        m, c = table[k]
        return Action(Op.F, m, c)

    def backward(k: int) -> Action:
        # Backward chunks run in reverse; the table is symmetric in microbatch ids per chunk.
        m, c = table[k]
        return Action(Op.B, m, v - 1 - c)

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(k + warmup), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def zb_h1_order(shape: PipelineShape, stage: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024), split backward I + W.

    Stage ``s`` runs 1F1B's ``p - s`` forwards, then ``s`` pairs (I, F) whose weight gradients it
    defers, then steady (I, W, F) triples, then the remaining I and W. Deferring W lets the input
    gradients (the critical path) travel upstream without waiting, and the deferred W fill the
    cool-down bubble. Activations are held until W, so every stage holds at most ``p``: the peak
    of stage 0 under 1F1B."""
    if shape.num_chunks != 1:
        raise ValueError(f"zb-h1 runs one model chunk per stage, got num_chunks={shape.num_chunks}")
    p, m_count = shape.num_stages, shape.num_microbatches
    warmup = min(p - stage, m_count)
    deferred = min(stage, m_count - warmup)
    order = [Action(Op.F, m) for m in range(warmup)]
    next_f, next_i, next_w = warmup, 0, 0
    for _ in range(deferred):
        order += [Action(Op.I, next_i), Action(Op.F, next_f)]
        next_i, next_f = next_i + 1, next_f + 1
    while next_f < m_count:
        order += [Action(Op.I, next_i), Action(Op.W, next_w), Action(Op.F, next_f)]
        next_i, next_w, next_f = next_i + 1, next_w + 1, next_f + 1
    while next_i < m_count:
        order += [Action(Op.I, next_i), Action(Op.W, next_w)]
        next_i, next_w = next_i + 1, next_w + 1
    order += [Action(Op.W, m) for m in range(next_w, m_count)]
    return order
