"""trainer.schedule.backward_pool: the host-time model's price of a graphed split backward's shared
backward pool (evacuations into shared sets, early W's), its state machine against the runtime's
(trainer/pipeline/graph_operands.py, BackwardPoolState), and the simulator's flags for it."""

from __future__ import annotations

import functools

import pytest

from trainer.schedule.backward_pool import BackwardPoolModel, PoolSpec
from trainer.schedule.compare import ScheduleSpec, run_once
from trainer.schedule.core import Action, Op
from trainer.schedule.costs import CostModel
from trainer.schedule.host_ahead import simulate_host_ahead
from trainer.schedule.simulate import main as simulate_main


def _run(pool: BackwardPoolModel, ops: str) -> list[tuple[float, float]]:
    """Replay ``ops`` ("I0 I1 W0 ...", chunk 0, every W taking 1.0) through ``pool``."""
    kinds = {"F": Op.F, "B": Op.B, "I": Op.I, "W": Op.W}
    return [pool.run(Action(kinds[op[0]], int(op[1:]), 0), lambda m, c: 1.0, 1.0) for op in ops.split()]


def test_a_w_right_after_its_i_is_free_and_another_backward_first_evacuates_it() -> None:
    pool = BackwardPoolModel(sets=2, copy=0.25)
    assert _run(pool, "F0 I0 W0") == [(0.0, 1.0)] * 3 and pool.counts() == (1, 0, 0)
    # I1 comes before W0: W0's operands are copied to a set first (a quarter of its W time)
    assert _run(pool, "F0 I0 I1 W0 W1") == [(0, 1), (0, 1), (0.25, 1), (0.25, 1), (0, 1)]
    assert pool.counts() == (1, 2, 0) and pool.state.occupant == {}


def test_with_every_set_taken_the_holder_runs_its_w_before_the_next_backward_and_its_own_w_is_free() -> None:
    """As the runtime's BackwardPoolState: I0 I1 I2 I3 with two sets -- 0 and 1 evacuated, 2 finds none free
    and runs its W before I3; then W1 reads set 1, which is not free until after it, so 3 (in the pool)
    runs its W early too. Every W runs exactly once."""
    pool = BackwardPoolModel(sets=2, copy=0.5)
    got = _run(pool, "I0 I1 I2 I3 W2 W1 W3 W0")
    assert got == [(0, 1), (0.5, 1), (0.5, 1), (1.0, 1), (0, 0), (1.0, 1), (0, 0), (0, 1)]
    assert pool.counts() == (0, 2, 2) and not pool.state.occupant and not pool.state.done_early
    assert pool.state.holder is None
    unbounded = BackwardPoolModel(sets=None, copy=0.5)  # a set per slot: never early
    _run(unbounded, "I0 I1 I2 I3 W2 W1 W3 W0")
    assert unbounded.counts() == (0, 4, 0)
    with pytest.raises(ValueError, match="at least one"):
        BackwardPoolModel(sets=0)


@pytest.mark.parametrize("sets", [None, 1, 2])
def test_every_w_is_read_in_place_evacuated_or_run_early_exactly_once(sets: int | None) -> None:
    costs = CostModel(jitter=0.3, seq_len_sigma=0.4, edge_transfer=(0.05, 0.2, 0.05, 0.1))
    for v in (1, 2):
        result = run_once(ScheduleSpec("dpp-zb", v), 4, 16, costs, seed=5, simulator=functools.partial(
            simulate_host_ahead, launch=0.05, header_latency=0.05, max_queued_ops=1, data_aware=True,
            pool=PoolSpec(sets, 0.06)))
        w_per_stage = [16 * v] * 4 if v > 1 else [0, 16, 16, 16]  # v=1: stage 0 runs whole backwards
        assert [sum(c) for c in result.pool_counts] == w_per_stage, result.pool_counts


def test_free_copies_and_a_set_per_slot_change_nothing() -> None:
    """The pool priced at zero with a set per slot is the unpriced model: same step, same busy time."""
    costs = CostModel(jitter=0.3, edge_transfer=(0.05, 0.2, 0.05, 0.1))
    plain = functools.partial(simulate_host_ahead, launch=0.05, header_latency=0.05, max_queued_ops=1)
    free = functools.partial(plain, pool=PoolSpec(None, 0.0))
    for v in (1, 2):
        a = run_once(ScheduleSpec("dpp-zb", v), 4, 16, costs, seed=2, simulator=plain)
        b = run_once(ScheduleSpec("dpp-zb", v), 4, 16, costs, seed=2, simulator=free)
        assert a.step_time == pytest.approx(b.step_time) and a.busy == pytest.approx(b.busy)
        assert a.pool_counts is None and b.pool_counts is not None


def test_cli_prices_the_pool_and_names_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--pp", "2", "--vp", "2", "--microbatches", "8", "--schedules", "dpp-zb", "--host-ahead"]
    assert simulate_main([*flags, "--evacuation-sets", "1"]) == 0
    out = capsys.readouterr().out
    assert "backward pool, dpp-zb v=2: per stage W's read in place / evacuations / W's run early" in out
    for bad, why in ((["--evacuation-sets", "0"], "must be 'slots' or a number >= 1"),
                     (["--evacuation-sets", "slots", "--evacuation-copy", "-1"], "--evacuation-copy=-1.0 must be >= 0")):
        with pytest.raises(SystemExit):
            simulate_main([*flags, *bad])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main(["--pp", "2", "--evacuation-sets", "2"])
    assert "--evacuation-sets applies to --host-ahead" in capsys.readouterr().err
