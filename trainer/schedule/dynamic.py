"""The dynamic (greedy) pipeline policies: ``dpp`` and its split-backward variant ``dpp-zb``.

Each call looks only at what is ready *now* on this stage and picks:

* a **forward**, if the in-flight activation cap allows it and every microbatch started on
  this stage can still get slots for its later chunks (a banker's check, see
  :meth:`DynamicPolicy._is_safe_after`; optionally new microbatches also leave the slots owed
  to started ones alone, ``reserve_owed``);
* a **backward** (B, or its input-gradient half I), which is on the critical path of the stages
  upstream and frees memory;
* for ``dpp-zb`` a deferred **weight gradient** W: nobody waits for it, so it fills idle time
  and runs early only when it frees the memory a ready forward needs.

``priority`` orders forward vs backward; ``chunk_order`` and ``backward_chunk_order`` pick
depth-first (carry a started microbatch on) or breadth-first (start the next one) over chunks. Within a kind the oldest microbatch goes first. A policy is pure: it reads
the state and returns an action or ``None`` (wait for an arrival).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.problems import raise_if_any
from trainer.schedule.core import Action, Op, PipelineShape, StageState, cost_order
from trainer.schedule.static import interleaved_order, interleaved_warmup, peak_held_per_chunk

PRIORITIES = ("forward", "backward")
CHUNK_ORDERS = ("depth", "breadth")
CAP_BASES = ("stage", "peak")
MICROBATCH_ORDERS = ("cost", "index")
WEIGHT_ORDERS = ("oldest", "youngest")
CHUNK_CAPS = ("none", "interleaved")


def one_f_one_b_cap(shape: PipelineShape, stage: int) -> int:
    """In-flight activations (in chunk units) that Megatron-Core's schedule holds at most on
    ``stage``: ``p - s`` for 1F1B, the interleaved warm-up count + 1 for ``v > 1``."""
    if shape.num_chunks == 1:
        return min(shape.num_stages - stage, shape.num_microbatches)
    return min(interleaved_warmup(shape, stage) + 1, shape.num_microbatches * shape.num_chunks)


def scaled_cap(shape: PipelineShape, stage: int, factor: float) -> int:
    """``factor`` x :func:`one_f_one_b_cap`, rounded down (the tolerance keeps e.g. 1.5 x 2 at 3)."""
    return math.floor(factor * one_f_one_b_cap(shape, stage) + 1e-9)


def interleaved_chunk_caps(shape: PipelineShape, stage: int, factor: float = 1.0) -> tuple[int, ...]:
    """Per chunk, ``factor`` x the activations Megatron-Core's interleaved order holds at most in that
    chunk on ``stage`` (rounded down, at least 1): 8/4 on stage 0 at p = 4, v = 2, M = 32. Its two chunks
    do not peak together, so the sum exceeds :func:`one_f_one_b_cap` (12 against 11 there). Where Megatron
    refuses M (not a multiple of p), the order of M rounded up to one stands in, each count at most M."""
    p, m = shape.num_stages, shape.num_microbatches
    whole = PipelineShape(p, -(-m // p) * p, shape.num_chunks)
    peaks = peak_held_per_chunk(interleaved_order(whole, stage), shape.num_chunks, split_backward=False)
    return tuple(max(1, min(m, math.floor(factor * n + 1e-9))) for n in peaks)


@dataclass(frozen=True)
class DynamicOptions:
    """Knobs of the greedy policy (``make_policy(name, shape, stage, **options)``)."""

    max_inflight: int | None = None
    """Cap on activations held (chunk units: F done, B - or W for a split backward - not yet).
    None: ``cap_factor`` x the 1F1B bound chosen by ``cap_basis``."""
    cap_factor: float = 1.0
    """Multiplier on 1F1B's bound for the caps left as None (rounded down)."""
    cap_basis: str | None = None
    """Which 1F1B bound ``max_inflight`` defaults to: "stage" = this stage's (``p - s``);
    "peak" = stage 0's, the largest: the activation memory every GPU already needs for 1F1B,
    so the per-GPU peak does not grow. None: "stage" for dpp, "peak" for dpp-zb (ZB-H1's
    memory, which keeps the live activations at the stage bound and lets W lag behind)."""
    max_live: int | None = None
    """dpp-zb only: cap on *live* activations (F done, I not yet), which bounds how far this
    stage's forwards run ahead of its input gradients. None: ``cap_factor`` x this stage's 1F1B
    bound. Activations waiting only for W still count against ``max_inflight``."""
    reserve_owed: bool | None = None
    """Admit a new microbatch (chunk-0 forward) only while held activations plus the forwards
    already owed to started microbatches do not exceed the cap (a soft reservation: safety is
    the banker's check's job), so started microbatches are not starved of slots for their later
    chunks. False: admit
    whenever the (always applied) banker's check allows - fills faster, but under variable costs
    lets early chunks crowd out later ones. None: True for dpp, False for dpp-zb (measured best,
    docs/schedules.md). No effect when v = 1 (nothing is ever owed)."""
    priority: str = "forward"
    """"forward": a ready forward under the cap beats a ready backward; "backward": the reverse."""
    chunk_order: str = "depth"
    """Forwards of different chunks: "depth" = later chunks first (carry started microbatches
    on; frees memory soonest), "breadth" = chunk 0 first (admit new microbatches first)."""
    backward_chunk_order: str = "breadth"
    """Backwards of different chunks: "breadth" = later chunks first (the gradient with the
    longest way still to go, as Megatron's groups do), "depth" = earlier chunks first (finish a
    microbatch). Measured: breadth is 2-5% faster for v >= 2 (docs/schedules.md)."""
    microbatch_order: str = "cost"
    """Which microbatch is "oldest" (runs first among ready ones of a kind and chunk): "cost" =
    :func:`cost_order` of ``StageState.microbatch_costs`` when the runtime supplies them
    (sequence lengths, known before the forward), else the index; "index" = always the index.
    Every stage derives the same order from the same costs, so they agree without talking."""
    weight_order: str | None = None
    """dpp-zb: which deferred weight gradient fills an idle slot first (in the microbatch order).
    None: "youngest" for v = 1, "oldest" for v > 1: measured, not derived (docs/schedules.md,
    "The default dynamic policy"). At v = 1 youngest first, paired over seeds 0-199, is faster with lengths (sigma
    0.4: -0.43 units) and transient stalls (1% x 8: -0.26) and within noise under jitter; at
    v = 2 it is not (lengths sigma 0.6 +0.14, stalls 1% x 8 +0.26). Which W runs changes no
    dependency and no cap (any W frees one slot); it changes which microbatch's W meets an idle
    slot, so which ops overlap a neighbour's stall and how long the filler is under lengths."""

    chunk_caps: str = "none"
    """v > 1: "interleaved" bounds each chunk's held activations by what Megatron-Core's interleaved
    order holds in that chunk (:func:`interleaved_chunk_caps`, x ``cap_factor``) on the stage
    ``cap_basis`` names (this one, or stage 0 for "peak"); "none": only the stage's cap. Why: with CUDA
    graphs every chunk captures a slot per activation it may hold, and without per-chunk caps a
    forward may take any chunk's slot, so each chunk captures the whole cap (11/11 slots on stage 0 at
    p = 4, M = 32 against the interleaved order's 8/4; measured on one H200: 27.4 against 15.6 GiB
    peak reserved). The caps are Megatron's own per-chunk peaks, so the slots are the interleaved
    order's. Safe with the banker's check: a chunk-c slot is held only by microbatches whose
    remaining work here lies in later virtual stages, so one frees as the pipeline downstream drains."""

    split_first_stage: bool = False
    """dpp-zb at v = 1: whether stage 0 splits its backwards too. False (default): stage 0 runs whole
    backwards (B), the other stages I and W. Why: stage 0's input gradients feed no other stage,
    and with its held and live caps equal (the default: both its 1F1B bound) the split changes
    nothing -- while forwards remain, an I runs only with the held cap full, so the first-stage
    rule runs that microbatch's W right after it; once they are done, any non-idling order of the
    remaining work ends at the same time. The simulator agrees on every draw tried (p = 2/4/8, all
    scenarios of docs/schedules.md's table, 20 seeds each: identical steps). On a GPU the split is not free: each
    deferred GEMM's operands are held until W and, with --dpp-cuda-graphs, copied into buffers a
    slot owns (+1.42 GiB on the benchmark model's stage 0, the stage that sets peak memory and the
    busiest one). True: split there as well (for measurements). No effect at v > 1 (stage 0 also
    runs a middle chunk, whose input gradients do feed a stage) or with explicit unequal caps."""

    drain_lag: bool = True
    """dpp-zb at v = 1: once this stage's forwards are done, a deferred W fills idle time only while
    more than ``s`` (the stage index: ZB-H1's lag) are deferred, until its last input gradient; the
    ``s`` kept run after it. Why: in the drain every input gradient is on the critical path to stage
    0, and the gap before the next one is often shorter than a W (with I > W it is I_down - I_here +
    W_down: one W), so a second W started in it delays that gradient by up to one W, and stage 0
    with it; the ``s`` kept W's fit in the time the last gradient takes to reach stage 0 (ZB-H1's
    drain). Measured (docs/schedules.md, "dpp-zb against ZB-H1 on a bottleneck"): the middle-stage
    bottleneck re-split 4/5/5/2 393.84 -> 391.94 (= ZB-H1), balanced stages with I = 1.5 F,
    W = 0.75 F = ZB-H1 at p = 3-8; the medians under jitter, lengths and stalls move by <= 0.2%.
    It bounds the ``fill_transit`` W's as well: deciding at host time, the drain's W's otherwise
    run while the next gradient's data travels (host-time simulator with the 4xH200 costs: 5/4/4/3
    406.95 -> 405.92, 4/5/5/2 395.07 -> 392.29 = ZB-H1). False: fill with every deferred W in the
    drain too."""

    fill_transit: bool = True
    """dpp-zb: when every ready input gradient is still on its way to the device (its header came
    first: ``StageState.grads_in_transit``), run a deferred W meanwhile instead of queueing the I
    to wait on the stream. Why: a runtime that decides at host time hears of a gradient as soon
    as the neighbour *queued* the op producing it, so at host time "nothing but W ready" almost
    never holds -- W never fills idle time, the deferred W's fill the held cap instead, and each
    forward then waits for a W right when the next stage needs it (host-time simulator with the
    GPU's I/W split, docs/schedules.md). No effect where arrival means landed (GPU-time simulator)."""

    land_forwards: bool | None = None
    """The same look for forwards: when the forward this stage would run next has its input
    activation still on the way (``StageState.acts_in_transit``), run instead, in this order, a ready
    forward whose activation has landed (if the caps admit it), an input gradient that has landed, or
    a deferred W (in the drain only above ZB-H1's lag); queue the travelling forward only when none is
    ready. None: on for dpp-zb at v > 1 with ``fill_transit``, off otherwise. Why: at v > 1 a
    microbatch's forward crosses every stage twice, so at host time the next forward's header nearly
    always names an activation whose producing op has just been queued upstream; queued first, it holds
    the stream while that op runs, a chain through all stages each step (host-time simulator, 4xH200
    op costs, PP=4 M=32 on the chunk split, one op queued ahead: dpp-zb v=2 477.70 -> 362.20 against
    the interleaved order's 369.69; PP=2 704.01 -> 687.32 against 690.10; docs/schedules.md). Off at
    v = 1, where forwards come in order: a W ahead of the next forward delays it (up to +1.1% there),
    and for dpp, which has no W to fill with: its forwards taken out of the depth order cost +12 to
    +17% at PP=2. No effect where arrival means landed (GPU-time simulator, CPU runs)."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("max_inflight", "max_live"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                problems.append(f"{name}={value!r} must be an integer >= 1")
        if not (isinstance(self.cap_factor, int | float) and math.isfinite(self.cap_factor)
                and self.cap_factor >= 1.0):
            problems.append(f"cap_factor={self.cap_factor!r} must be a finite number >= 1")
        if self.cap_basis is not None and self.cap_basis not in CAP_BASES:
            problems.append(f"cap_basis={self.cap_basis!r} not in {CAP_BASES}")
        if self.priority not in PRIORITIES:
            problems.append(f"priority={self.priority!r} not in {PRIORITIES}")
        for name in ("chunk_order", "backward_chunk_order"):
            if getattr(self, name) not in CHUNK_ORDERS:
                problems.append(f"{name}={getattr(self, name)!r} not in {CHUNK_ORDERS}")
        if self.microbatch_order not in MICROBATCH_ORDERS:
            problems.append(f"microbatch_order={self.microbatch_order!r} not in {MICROBATCH_ORDERS}")
        if self.weight_order is not None and self.weight_order not in WEIGHT_ORDERS:
            problems.append(f"weight_order={self.weight_order!r} not in {WEIGHT_ORDERS}")
        if self.chunk_caps not in CHUNK_CAPS:
            problems.append(f"chunk_caps={self.chunk_caps!r} not in {CHUNK_CAPS}")
        raise_if_any(problems, "invalid dynamic schedule options")

    def _scaled_bound(self, shape: PipelineShape, stage: int) -> int:
        return scaled_cap(shape, stage, self.cap_factor)

    def resolve_caps(
        self, shape: PipelineShape, stage: int, split_backward: bool
    ) -> tuple[int, int | None]:
        """(held cap, live cap or None) for ``stage``. The held cap is at least ``v``: one
        microbatch needs a slot per chunk on every stage."""
        if not split_backward and self.max_live is not None:
            raise ValueError(f"max_live={self.max_live} applies to dpp-zb only (split backward)")
        basis = self.cap_basis or ("peak" if split_backward else "stage")
        cap = self.max_inflight
        if cap is None:
            cap = self._scaled_bound(shape, stage if basis == "stage" else 0)
        if cap < shape.num_chunks:
            raise ValueError(
                f"stage {stage}: max_inflight={cap} < num_chunks={shape.num_chunks}: a microbatch "
                "needs one activation slot per chunk on every stage"
            )
        live = None
        if split_backward:
            live = self.max_live if self.max_live is not None else self._scaled_bound(shape, stage)
            live = min(live, cap)
        return cap, live

    def resolve_chunk_caps(self, shape: PipelineShape, stage: int, split_backward: bool) -> tuple[int, ...] | None:
        """Per-chunk held caps for ``stage`` (:attr:`chunk_caps`), or None: no per-chunk bound (also
        at v = 1, where the stage's cap is the chunk's)."""
        if self.chunk_caps == "none" or shape.num_chunks == 1:
            return None
        basis = self.cap_basis or ("peak" if split_backward else "stage")
        return interleaved_chunk_caps(shape, stage if basis == "stage" else 0, self.cap_factor)


class DynamicPolicy:
    """Greedy policy over the ready set; ``split_backward`` turns ``dpp`` into ``dpp-zb``."""

    def __init__(
        self, name: str, shape: PipelineShape, stage: int, options: DynamicOptions,
        split_backward: bool,
    ) -> None:
        self.name = name
        self.options = options
        self.cap, self.live_cap = options.resolve_caps(shape, stage, split_backward)
        self.chunk_caps = options.resolve_chunk_caps(shape, stage, split_backward)
        """Held activations allowed per chunk, or None (only :attr:`cap`); CUDA graph slots per chunk."""
        if (split_backward and not options.split_first_stage and stage == 0 and shape.num_chunks == 1
                and self.live_cap == self.cap):
            split_backward, self.live_cap = False, None  # whole backwards there: see split_first_stage
        self.split_backward = split_backward
        reserve = options.reserve_owed
        self.reserve_owed = (not split_backward) if reserve is None else reserve
        self._num_chunks = shape.num_chunks
        self._num_microbatches = shape.num_microbatches
        self._first_stage = stage == 0  # its chunk-0 input gradients feed no other stage
        # ZB-H1's lag, kept in the drain (DynamicOptions.drain_lag): v = 1 only, where the lag is s.
        self._drain_lag = stage if options.drain_lag and shape.num_chunks == 1 else 0
        self._forward_depth = options.chunk_order == "depth"
        self._backward_depth = options.backward_chunk_order == "depth"
        self._forward_first = options.priority == "forward"
        weight_order = options.weight_order or ("youngest" if shape.num_chunks == 1 else "oldest")
        self._youngest_weight = weight_order == "youngest"
        self.fill_transit = options.fill_transit
        self.tracks_landing = split_backward and options.fill_transit
        """Whether this policy reads ``StageState.grads_in_transit`` (the runtime then keeps it)."""
        land = options.land_forwards
        self.tracks_activation_landing = (split_backward and options.fill_transit and shape.num_chunks > 1
                                          if land is None else land)
        """Whether it reads ``StageState.acts_in_transit`` (DynamicOptions.land_forwards)."""
        self._keys_for: object = ()  # the microbatch_costs the cached keys were built for
        self._set_keys(list(range(shape.num_microbatches)))

    def _set_keys(self, rank: list[int]) -> None:
        """Sort keys: smaller wins; within a chunk, the earlier microbatch in ``rank``. A
        forward's data flows to later chunks and a backward's to earlier ones, so "depth" means a
        higher chunk for forwards and a lower one for backwards."""
        self._rank = rank
        if self._forward_depth:
            self._forward_key = lambda a: (-a.chunk, rank[a.microbatch])
        else:
            self._forward_key = lambda a: (a.chunk, rank[a.microbatch])
        if self._backward_depth:
            self._backward_key = lambda a: (a.chunk, rank[a.microbatch])
        else:
            self._backward_key = lambda a: (-a.chunk, rank[a.microbatch])

    def _refresh_keys(self, state: StageState) -> None:
        """Rebuild the sort keys when a step brings other cost estimates (once per step: the
        runtime keeps one policy and makes a new StageState each step)."""
        costs = state.microbatch_costs if self.options.microbatch_order == "cost" else None
        if costs is self._keys_for:
            return
        self._keys_for = costs
        order = cost_order(costs, self._num_microbatches)
        rank = [0] * self._num_microbatches
        for position, m in enumerate(order):
            rank[m] = position
        self._set_keys(rank)

    def __repr__(self) -> str:
        return f"DynamicPolicy({self.name!r}, cap={self.cap}, live_cap={self.live_cap}, {self.options})"

    def _admissible_forward(self, state: StageState, landed_only: bool = False) -> Action | None:
        """Best ready forward that keeps the stage *safe* under the cap, or None; ``landed_only``:
        among those whose input activation is on the device."""
        ready = state.ready_of(Op.F)
        if landed_only:
            ready = [a for a in ready if (a.microbatch, a.chunk) not in state.acts_in_transit]
        if not ready or state.inflight >= self.cap:
            return None
        if self.chunk_caps is not None:
            held, caps = state.inflight_per_chunk, self.chunk_caps
            ready = [a for a in ready if held[a.chunk] < caps[a.chunk]]
            if not ready:
                return None
        if self.live_cap is not None and state.inflight - len(state.ready_of(Op.W)) >= self.live_cap:
            # Only new microbatches wait for the live cap: a started one must finish its
            # later chunks (the banker's check below guarantees them room).
            ready = [a for a in ready if a.chunk > 0]
            if not ready:
                return None
        if self.reserve_owed and state.inflight + state.reserved_forwards > self.cap:
            # Started microbatches are owed more forwards than there are free slots: no newcomer.
            ready = [a for a in ready if a.chunk > 0]
            if not ready:
                return None
        best = min(ready, key=self._forward_key)  # type: ignore[arg-type]
        if self._is_safe_after(state, best):
            return best
        for action in sorted(ready, key=self._forward_key)[1:]:
            if self._is_safe_after(state, action):
                return action
        return None

    def _is_safe_after(self, state: StageState, forward: Action) -> bool:
        """Banker's check: after ``forward``, can every started microbatch still get the slots for
        its remaining chunks here, serving them oldest first (each one then releases all it
        holds)? Without it, interleaved microbatches can fill the cap with early-chunk activations
        and deadlock waiting for later-chunk slots. Oldest first (in the microbatch order every
        stage shares) is the order in which upstream stages deliver, so it is the order to check."""
        free = self.cap - state.inflight - 1
        v = self._num_chunks
        owed = state.reserved_forwards + (v - 1 if forward.chunk == 0 else -1)
        if free >= owed:  # room for everything owed: the common, O(1) case (always when v == 1)
            return free >= 0
        open_microbatches = state.open_microbatches()
        for m in sorted(open_microbatches.keys() | {forward.microbatch}, key=self._rank.__getitem__):
            forwards_done, held = open_microbatches.get(m, (0, 0))
            if m == forward.microbatch:
                forwards_done, held = forwards_done + 1, held + 1
            if v - forwards_done > free:
                return False
            free += held
        return True

    def choose(self, state: StageState) -> Action | None:
        self._refresh_keys(state)
        backward_ready = state.ready_of(state.backward_op)
        backward = min(backward_ready, key=self._backward_key) if backward_ready else None
        if backward is not None and not self._forward_first:
            return backward
        forward = self._admissible_forward(state)
        if forward is not None:
            if self.tracks_activation_landing and (forward.microbatch, forward.chunk) in state.acts_in_transit:
                instead = self._landed_instead_of_forward(state, backward_ready)
                if instead is not None:
                    return instead
            return forward
        if (backward is not None and self.split_backward and self._first_stage and backward.chunk == 0
                and state.inflight >= self.cap and state.ready_of(Op.F) and state.ready_of(Op.W)):
            # The first virtual stage's I feeds nobody, while a forward blocked by the held cap
            # is what the next stage waits for: the oldest W frees the slot that forward needs.
            return self._weight(state.ready_of(Op.W))
        if backward is not None and state.grads_in_transit:
            landed = self._landed_backward(state, backward_ready)
            if landed is not None:  # one whose gradient is on the device runs now, not after one still on the way
                return landed
            if (self.split_backward and self.fill_transit and state.ready_of(Op.W)
                    and self._fills_drain(state, len(state.ready_of(Op.W)))):
                # Every ready gradient is still on the way: a deferred W fills the wait (the I
                # would only hold the stream). See DynamicOptions.fill_transit; in the drain only
                # above ZB-H1's lag (drain_lag): the gradient may land before the W ends.
                return self._weight(state.ready_of(Op.W))
        if backward is not None:
            return backward
        if self.split_backward:
            weight_ready = state.ready_of(Op.W)
            if weight_ready and self._fills_drain(state, len(weight_ready)):
                # nothing urgent is ready: fill the idle time with deferred W
                return self._weight(weight_ready)
        return None

    def _weight(self, ready: Sequence[Action]) -> Action:
        """The deferred W to run among ``ready`` (DynamicOptions.weight_order)."""
        return (max if self._youngest_weight else min)(ready, key=self._backward_key)

    def _landed_backward(self, state: StageState, backward_ready: Sequence[Action]) -> Action | None:
        """The first ready backward whose gradient is on the device, or None."""
        landed = [a for a in backward_ready if (a.microbatch, a.chunk) not in state.grads_in_transit]
        return min(landed, key=self._backward_key) if landed else None

    def _landed_instead_of_forward(self, state: StageState, backward_ready: Sequence[Action]) -> Action | None:
        """What runs instead of a forward whose activation is still on the way (DynamicOptions.
        land_forwards): a forward whose activation has landed, a landed gradient's backward, or a
        deferred W; None: nothing landed is ready, so the travelling forward is queued after all."""
        landed = self._admissible_forward(state, landed_only=True) or self._landed_backward(state, backward_ready)
        if landed is not None:
            return landed
        weight_ready = state.ready_of(Op.W) if self.split_backward else ()
        if weight_ready and self._fills_drain(state, len(weight_ready)):
            return self._weight(weight_ready)
        return None

    def _fills_drain(self, state: StageState, deferred: int) -> bool:
        """Whether a deferred W may fill idle time now: always, except in the drain (every forward
        done, input gradients still to come) with no more than ZB-H1's lag deferred; then the stage
        waits for the next input gradient (DynamicOptions.drain_lag)."""
        if deferred > self._drain_lag:
            return True
        done = state.done_count
        per_op = self._num_microbatches  # v = 1 whenever the lag is > 0
        return done(Op.F) < per_op or done(Op.I) >= per_op
