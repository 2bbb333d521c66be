"""The order-free bound (trainer/schedule/bound.py): exact where the pipeline has one microbatch, never
beaten by any schedule on any cost draw, and printed by the simulator's table."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from trainer.schedule import PipelineShape
from trainer.schedule.bound import order_free_bound
from trainer.schedule.compare import ScheduleSpec, draw, run_once
from trainer.schedule.costs import CostModel
from trainer.schedule.host_ahead import simulate_host_ahead
from trainer.schedule.registry import POLICY_NAMES, supports_chunks
from trainer.schedule.simulate import main as simulate_main


def _bound(costs: CostModel, p: int, m: int, v: int = 1):
    return order_free_bound(costs.draw(PipelineShape(p, m, v), np.random.default_rng(0)))


def test_uniform_costs_by_hand() -> None:
    # F = I = W = 1 per stage, p = 4, m = 8: stage 3's first input after 3 forwards, then 8 x 3 of work = 27;
    # the backward's: stage 0's first gradient after 4 forwards and 3 input gradients, then 8 x 2 = 23.
    bound = _bound(CostModel(), 4, 8)
    assert (bound.step, bound.stage, bound.start, bound.work, bound.backward) == (27, 3, 3, 24, False)
    assert bound.balanced == 24
    # Hops count: 0.5 per edge puts stage 3's first input at 3 + 3 x 0.5.
    assert _bound(CostModel(transfer=0.5), 4, 8).step == 28.5
    # Two chunks per stage: chunk 0 is half a stage, so the first input reaches stage 3 after 1.5.
    assert _bound(CostModel(), 4, 8, v=2).step == 25.5


def test_one_microbatch_the_bound_is_the_step_and_comes_from_the_backward() -> None:
    # p = 2, m = 1: F0, F1, B1, B0 in a row; stage 0's first gradient arrives at 3, its backward work is 2.
    bound = _bound(CostModel(), 2, 1)
    assert (bound.step, bound.stage, bound.backward) == (5, 0, True)
    # A split backward reaches it; a whole backward sends its gradient after I and W, one W later.
    for name, step in (("zb-h1", 5), ("dpp-zb", 5), ("1f1b", 6), ("gpipe", 6), ("dpp", 6)):
        assert run_once(ScheduleSpec(name), 2, 1, CostModel(), seed=0).step_time == pytest.approx(step), name


VARIED = {"uniform": CostModel(), "jitter": CostModel(jitter=0.3), "lengths": CostModel(seq_len_sigma=0.6),
          "stalls": CostModel(stall_probability=0.05, stall_duration=3.0),
          "slow edge": CostModel(edge_transfer=(0.1, 0.8, 0.1, 0.3)),
          "uneven": CostModel(stage_scale=(1.3, 1.0, 0.9, 1.1), transfer=0.05)}


@pytest.mark.parametrize("variation", sorted(VARIED))
@pytest.mark.parametrize("v", [1, 2])
def test_no_schedule_beats_the_bound(variation: str, v: int) -> None:
    costs = VARIED[variation]
    host = functools.partial(simulate_host_ahead, launch=0.01, header_latency=0.01)
    for name in (n for n in POLICY_NAMES if supports_chunks(n, v)):
        spec = ScheduleSpec(name, v)
        for seed in range(3):
            table = draw(spec, 4, 16, costs, seed)
            bound = order_free_bound(table)
            assert bound.balanced <= bound.step
            for simulator in (None, host):
                kwargs = {} if simulator is None else {"simulator": simulator}
                step = run_once(spec, 4, 16, costs, seed, table=table, **kwargs).step_time
                assert step >= bound.step - 1e-9, (name, v, variation, seed, step, bound)


def test_the_table_prints_each_schedule_over_the_bound(capsys) -> None:
    assert simulate_main(["--pp", "4", "--vp", "2", "--microbatches", "16", "--schedules", "interleaved,dpp"]) == 0
    out = capsys.readouterr().out
    assert "vs bound" in out
    assert "order-free bound, v=1 (no order runs these costs faster; first seed): 51.00 (stage 3" in out
    assert "order-free bound, v=2 (no order runs these costs faster; first seed): 49.50 (stage 3" in out
    row = next(line for line in out.splitlines() if line.startswith("interleaved"))
    assert float(row.split()[4].rstrip("x")) > 1.0
