"""Policies and the StageState bookkeeping they rely on (pure: no simulator timing involved)."""

from __future__ import annotations

import random

import pytest

from trainer.schedule import Action, Op, PipelineShape, Policy, StageState, make_policy, one_f_one_b_cap
from trainer.schedule.registry import POLICY_NAMES
from trainer.schedule.static import interleaved_order, megatron_schedule_table, zb_h1_order


def _brute_force_ready(state: StageState) -> list[Action]:
    return sorted((a for a in state.all_actions() if state.is_ready(a)),
                  key=lambda a: (a.op.value, a.microbatch, a.chunk))


@pytest.mark.parametrize("split", [False, True])
def test_incremental_ready_sets_match_brute_force(split):
    """The O(ready) bookkeeping must agree with the definition (is_ready over all actions) after
    every event of a random but legal event sequence."""
    rng = random.Random(7)
    shape = PipelineShape(num_stages=3, num_microbatches=5, num_chunks=2)
    state = StageState(shape, stage=1, split_backward=split)
    pending_inputs = [(m, c) for m in range(5) for c in range(2)]
    rng.shuffle(pending_inputs)
    while not state.finished:
        assert state.ready_actions() == _brute_force_ready(state)
        choices = list(state.ready_actions())
        if pending_inputs and (not choices or rng.random() < 0.4):
            m, c = pending_inputs.pop()
            state.mark_activation_arrived(m, c)
            continue
        forwarded = [a for a in state.done if a.op is Op.F
                     and (a.microbatch, a.chunk) not in state.grads_arrived]
        if forwarded and rng.random() < 0.3:
            a = rng.choice(forwarded)
            state.mark_grad_arrived(a.microbatch, a.chunk)
            continue
        if choices:
            state.mark_done(rng.choice(choices))
    assert state.inflight == 0 and state.reserved_forwards == 0 and not state.open_microbatches()


def test_make_policy_rejects_bad_names_options_and_shapes():
    shape = PipelineShape(4, 8)
    with pytest.raises(ValueError, match="unknown schedule 'zb-h9'"):
        make_policy("zb-h9", shape, 0)
    with pytest.raises(ValueError, match=r"takes no option\(s\) \['max_inflight'\]"):
        make_policy("1f1b", shape, 0, max_inflight=3)
    with pytest.raises(ValueError, match=r"\['cap'\]"):
        make_policy("dpp", shape, 0, cap=3)
    with pytest.raises(ValueError, match="stage=4 outside"):
        make_policy("dpp", shape, 4)
    with pytest.raises(ValueError, match="needs num_chunks >= 2"):
        make_policy("interleaved", shape, 0)
    with pytest.raises(ValueError, match="needs num_chunks == 1"):
        make_policy("1f1b", PipelineShape(4, 8, 2), 0)
    with pytest.raises(ValueError, match="priority='sideways'.*chunk_order='deep'"):
        make_policy("dpp", shape, 0, priority="sideways", chunk_order="deep")
    with pytest.raises(ValueError, match="max_inflight=1 < num_chunks=2"):
        make_policy("dpp", PipelineShape(4, 8, 2), 0, max_inflight=1)
    with pytest.raises(ValueError, match="max_live=2 applies to dpp-zb only"):
        make_policy("dpp", shape, 0, max_live=2)
    with pytest.raises(ValueError, match="last group of 2 < num_stages=4"):
        make_policy("interleaved", PipelineShape(4, 10, 2), 0)


def test_default_caps_are_megatrons_bounds():
    shape = PipelineShape(4, 32)
    assert [make_policy("dpp", shape, s).cap for s in range(4)] == [4, 3, 2, 1]
    assert [make_policy("dpp", shape, s, cap_factor=1.5).cap for s in range(4)] == [6, 4, 3, 1]
    assert [make_policy("dpp", shape, s, max_inflight=5).cap for s in range(4)] == [5] * 4
    # dpp-zb: held activations within 1F1B's per-GPU peak, live ones within the stage's bound.
    zb = [make_policy("dpp-zb", shape, s) for s in range(4)]
    # (stage 0 runs whole backwards: see DynamicOptions.split_first_stage)
    assert [(p.cap, p.live_cap) for p in zb] == [(4, None), (4, 3), (4, 2), (4, 1)]
    assert [p.split_backward for p in zb] == [False, True, True, True]
    from trainer.schedule.compare import describe_caps

    assert describe_caps(zb) == "4,4/3,4/2,4/1"  # the simulator's caps column
    assert make_policy("dpp-zb", shape, 0, split_first_stage=True).split_backward
    assert all(make_policy("dpp-zb", PipelineShape(4, 32, 2), s).split_backward for s in range(4))
    # v > 1: Megatron's interleaved warm-up count + 1 = 2 (p - s - 1) + (v - 1) p + 1.
    shape2 = PipelineShape(4, 32, 2)
    assert [one_f_one_b_cap(shape2, s) for s in range(4)] == [11, 9, 7, 5]
    assert [make_policy("dpp", shape2, s).cap for s in range(4)] == [11, 9, 7, 5]


def test_interleaved_uses_megatrons_schedule_table():
    """Our table must be Megatron-Core's own (installed) get_schedule_table, group size p."""
    from megatron.core.pipeline_parallel import schedules as megatron_schedules  # a dependency

    for m_count, v, group in [(8, 2, 4), (10, 3, 4), (12, 2, 6), (6, 4, 3)]:
        assert megatron_schedule_table(m_count, v, group) == megatron_schedules.get_schedule_table(
            m_count, v, group)


def test_interleaved_order_warmup_and_reverse_chunk_backwards():
    shape = PipelineShape(2, 4, 2)
    order = [str(a) for a in interleaved_order(shape, 0)]
    # stage 0 of p=2: warm-up 2*(2-0-1) + (2-1)*2 = 4 forwards, then 1F1B over virtual microbatches.
    assert order == ["F0.c0", "F1.c0", "F0.c1", "F1.c1",
                     "F2.c0", "B0.c1", "F3.c0", "B1.c1", "F2.c1", "B0.c0", "F3.c1", "B1.c0",
                     "B2.c1", "B3.c1", "B2.c0", "B3.c0"]


def test_zb_h1_order_defers_weight_gradients():
    order = [str(a) for a in zb_h1_order(PipelineShape(3, 5), 1)]
    assert order == ["F0.c0", "F1.c0", "I0.c0", "F2.c0", "I1.c0", "W0.c0", "F3.c0",
                     "I2.c0", "W1.c0", "F4.c0", "I3.c0", "W2.c0", "I4.c0", "W3.c0", "W4.c0"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policies_wait_with_nothing_ready_and_never_mutate_state(name):
    v = 2 if name == "interleaved" else 1
    shape = PipelineShape(3, 6, v)
    state = StageState(shape, stage=1, split_backward=name in ("zb-h1", "dpp-zb"))
    policy = make_policy(name, shape, 1)
    assert isinstance(policy, Policy) and policy.name == name
    assert policy.choose(state) is None  # stage 1: nothing has arrived yet
    state.mark_activation_arrived(0, 0)
    before = (set(state.done), set(state.activations_arrived), state.inflight)
    assert policy.choose(state) == Action(Op.F, 0, 0)
    assert (set(state.done), set(state.activations_arrived), state.inflight) == before


def test_state_rebuilt_from_prefilled_sets_matches_the_incremental_one():
    """A StageState constructed mid-step (public sets pre-filled) derives the same bookkeeping."""
    shape = PipelineShape(2, 3, 2)
    live = StageState(shape, stage=0)
    for action in (Action(Op.F, 0, 0), Action(Op.F, 1, 0)):
        live.mark_done(action)
    live.mark_activation_arrived(0, 1)
    live.mark_done(Action(Op.F, 0, 1))
    rebuilt = StageState(shape, stage=0, done=set(live.done),
                         activations_arrived=set(live.activations_arrived), inflight=live.inflight)
    assert rebuilt.ready_actions() == live.ready_actions()
    assert rebuilt.open_microbatches() == live.open_microbatches() == {0: [2, 2], 1: [1, 1]}
    assert rebuilt.reserved_forwards == live.reserved_forwards == 1


def test_cost_order_is_a_pyramid_and_index_without_costs():
    from trainer.schedule.dynamic import cost_order

    assert cost_order(None, 4) == [0, 1, 2, 3]
    assert cost_order((1.0,) * 4, 4) == [0, 1, 2, 3]
    # cheapest first, dearest in the middle, second cheapest last
    assert cost_order((5.0, 1.0, 3.0, 2.0, 4.0), 5) == [1, 2, 0, 4, 3]


def test_microbatch_costs_order_every_stage_the_same_way():
    shape = PipelineShape(2, 4)
    costs = (3.0, 1.0, 4.0, 2.0)
    state = StageState(shape, 0, microbatch_costs=costs)
    policy = make_policy("dpp", shape, 0)
    assert policy.choose(state) == Action(Op.F, 1, 0)  # the cheapest starts the pipeline
    assert make_policy("dpp", shape, 0, microbatch_order="index").choose(state) == Action(Op.F, 0, 0)
    assert make_policy("1f1b", shape, 0, microbatch_order="cost").choose(state) == Action(Op.F, 1, 0)
    assert make_policy("1f1b", shape, 0).choose(state) == Action(Op.F, 0, 0)
    with pytest.raises(ValueError, match="microbatch_costs needs num_microbatches=4.*got 2"):
        StageState(shape, 0, microbatch_costs=(1.0, 2.0))
    with pytest.raises(ValueError, match="microbatch_order='size'.*weight_order='newest'"):
        make_policy("dpp-zb", shape, 0, microbatch_order="size", weight_order="newest")


def test_dpp_zb_first_stage_runs_w_to_unblock_a_forward_before_an_i_that_feeds_nobody():
    # PP=2, stage 0: F0 F1 fill the held cap (2); I0 ran; grad 1 arrived, so I1 and W0 are ready
    # and F2 waits only for a slot. Stage 0's I feeds no upstream stage, while stage 1 waits for F2:
    # W0 frees the slot (ZB-H1's F I W rhythm). A later stage keeps I first (its upstream waits).
    shape = PipelineShape(2, 8)
    for stage, expected in ((0, Action(Op.W, 0)), (1, Action(Op.I, 1))):
        # split_first_stage: by default stage 0 runs whole backwards; this is the rule that makes
        # that equivalent (here asked for explicitly, so stage 0 splits).
        policy = make_policy("dpp-zb", shape, stage, split_first_stage=True)
        state = StageState(shape, stage, split_backward=True)
        for m in (0, 1):
            if stage == 1:
                state.mark_activation_arrived(m, 0)
            state.mark_done(Action(Op.F, m))
        if stage == 0:
            state.mark_grad_arrived(0, 0)
            state.mark_grad_arrived(1, 0)
        state.mark_done(Action(Op.I, 0))
        if stage == 1:
            state.mark_activation_arrived(2, 0)
        assert state.inflight >= policy.cap and state.ready_of(Op.F) and state.ready_of(Op.W)
        assert policy.choose(state) == expected, stage


def test_dpp_zb_at_v2_runs_a_landed_op_before_a_forward_whose_activation_is_on_its_way():
    """DynamicOptions.land_forwards: the forward it would run next (depth first: chunk 1) has its header
    but not its data; a landed forward goes first, then a landed gradient's I, then a deferred W, and the
    travelling forward only when nothing landed is ready."""
    shape = PipelineShape(4, 8, 2)
    state = StageState(shape, 1, split_backward=True)
    policy = make_policy("dpp-zb", shape, 1)
    assert policy.tracks_activation_landing and policy.tracks_landing
    state.mark_activation_arrived(0, 0, landed=False)
    assert state.acts_in_transit == {(0, 0)}
    assert policy.choose(state) == Action(Op.F, 0, 0)  # nothing landed is ready: queue it after all
    state.mark_activation_arrived(1, 0)
    assert policy.choose(state) == Action(Op.F, 1, 0)  # the landed forward first
    for action in (Action(Op.F, 0, 0), Action(Op.F, 1, 0)):
        state.mark_done(action)
    assert state.acts_in_transit == set()
    state.mark_activation_arrived(0, 1)
    state.mark_done(Action(Op.F, 0, 1))
    state.mark_grad_arrived(0, 1)
    state.mark_done(Action(Op.I, 0, 1))
    state.mark_activation_arrived(1, 1, landed=False)  # depth first: F1.c1 is the forward it would run
    assert policy.choose(state) == Action(Op.W, 0, 1)  # a deferred W meanwhile
    state.mark_grad_arrived(0, 0)
    assert policy.choose(state) == Action(Op.I, 0, 0)  # a landed gradient's I before that W
    state.mark_activation_landed(1, 1)
    assert policy.choose(state) == Action(Op.F, 1, 1)  # landed: the forward goes first again
    # The header alone decides where the option is off: at v = 1, without fill_transit, and for dpp.
    assert not make_policy("dpp-zb", PipelineShape(4, 8), 1).tracks_activation_landing
    assert not make_policy("dpp-zb", shape, 1, fill_transit=False).tracks_activation_landing
    assert not make_policy("dpp", shape, 1).tracks_activation_landing
    off = make_policy("dpp-zb", shape, 1, land_forwards=False)
    state.mark_activation_arrived(2, 0, landed=False)
    state.mark_done(Action(Op.I, 0, 0))
    assert off.choose(state) == Action(Op.F, 1, 1) and not off.tracks_activation_landing
    state.acts_in_transit.add((1, 1))
    assert off.choose(state) == Action(Op.F, 1, 1)
    assert make_policy("dpp", shape, 1, land_forwards=True).tracks_activation_landing


def _stage1_of_four_with_two_live_and_one_w() -> tuple[PipelineShape, StageState]:
    """PP=4, stage 1 (live cap 3, held cap 4): F0..F2 ran, I0 ran (W0 deferred), F3's activation is
    not here; gradients of microbatches 1 and 2 arrive below."""
    shape = PipelineShape(4, 8)
    state = StageState(shape, 1, split_backward=True)
    for m in range(3):
        state.mark_activation_arrived(m, 0)
        state.mark_done(Action(Op.F, m))
    state.mark_grad_arrived(0, 0)
    state.mark_done(Action(Op.I, 0))
    return shape, state


def test_dpp_zb_fills_with_w_while_every_ready_gradient_is_still_on_its_way():
    shape, state = _stage1_of_four_with_two_live_and_one_w()
    policy = make_policy("dpp-zb", shape, 1)
    assert policy.tracks_landing
    state.mark_grad_arrived(1, 0, landed=False)  # header here, data not: a W runs meanwhile
    assert state.grads_in_transit == {(1, 0)}
    assert policy.choose(state) == Action(Op.W, 0)
    state.mark_grad_arrived(2, 0)  # a landed one goes before the one still travelling
    assert policy.choose(state) == Action(Op.I, 2)
    state.mark_grad_landed(1, 0)
    assert policy.choose(state) == Action(Op.I, 1)
    state.mark_done(Action(Op.I, 1))
    assert state.grads_in_transit == set()
    # without the option the header is enough, as before
    shape, state = _stage1_of_four_with_two_live_and_one_w()
    state.mark_grad_arrived(1, 0, landed=False)
    off = make_policy("dpp-zb", shape, 1, fill_transit=False)
    assert not off.tracks_landing and off.choose(state) == Action(Op.I, 1)
    # plain dpp has no W to fill with: it runs the travelling gradient's B (the stream waits)
    assert not make_policy("dpp", shape, 1).tracks_landing
