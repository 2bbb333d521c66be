"""trainer.pipeline.run_ahead: ``--dpp-max-queued-ops`` keeps at most K unfinished ops queued before
the host decides the next one, never waits on CPU, and fails naming rank and op instead of hanging."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config, resolve_plan
from trainer.pipeline.run_ahead import RunAheadBound
from trainer.pipeline.stall import DppStallError


class FakeEvent:
    """Finishes after ``polls`` queries (the GPU working through the op)."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _bound(limit: int, polls: list[int], timeout_s: float = 1.0) -> tuple[RunAheadBound, list[FakeEvent], Clock]:
    events = [FakeEvent(p) for p in polls]
    made = iter(events)
    clock = Clock()
    return RunAheadBound(limit, rank=3, timeout_s=timeout_s, make_event=lambda: next(made), clock=clock,
                         sleep=clock.sleep), events, clock


def test_waits_only_while_more_than_k_ops_are_unfinished() -> None:
    bound, events, clock = _bound(2, [5, 5, 5, 5])
    bound.before_decide()  # nothing queued
    for name in ("F0", "F1"):
        bound.after_op(name)
        bound.before_decide()  # 1, then 2 unfinished: within K=2, no wait
    assert clock.now == 0.0
    bound.after_op("F2")
    bound.before_decide()  # 3 unfinished: waits until F0's event finished, not longer
    assert events[0].polls < 0 and events[1].polls >= 0
    assert clock.now > 0 and bound.waited_s == pytest.approx(clock.now)
    bound.begin_step()  # the step's figure starts again, the run's total keeps it (end-of-run log)
    assert bound.waited_s == 0.0 and bound.total_waited_s == pytest.approx(clock.now)


def test_finished_ops_leave_the_queue_without_waiting() -> None:
    bound, _, clock = _bound(1, [0, 0, 0])
    for name in ("F0", "B0", "F1"):
        bound.after_op(name)
        bound.before_decide()
    assert clock.now == 0.0


def test_a_stuck_gpu_raises_naming_rank_and_op() -> None:
    bound, _, _ = _bound(1, [10**9, 10**9], timeout_s=0.5)
    bound.after_op("F(m4,c0)")
    bound.after_op("F(m5,c0)")
    with pytest.raises(DppStallError, match=r"rank 3 waited 0s for its GPU to finish F\(m4,c0\)"):
        bound.before_decide()


def test_cpu_and_k0_never_wait() -> None:
    import torch

    for limit, device in ((2, torch.device("cpu")), (0, torch.device("cpu"))):
        bound = RunAheadBound.for_device(limit, 0, 1.0, device)
        assert not bound.active
        bound.after_op("F0")
        bound.before_decide()


def test_begin_step_forgets_the_last_steps_ops() -> None:
    bound, _, clock = _bound(0, [10**9])
    bound.after_op("B31")
    bound.begin_step()
    bound.before_decide()
    assert clock.now == 0.0


def test_flag_is_checked_before_anything_starts() -> None:
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--mock-data", "--train-iters", "1", "--pipeline-model-parallel-size", "2", "--device", "cpu"]
    with pytest.raises(ConfigError, match=r"--dpp-max-queued-ops=-1 must be >= 0"):
        parse_config([*base, "--use-dpp", "--dpp-max-queued-ops", "-1"], world_size=2)
    with pytest.raises(ConfigError, match=r"--dpp-max-queued-ops=2 applies to --use-dpp"):
        parse_config([*base, "--dpp-max-queued-ops", "2"], world_size=2)
    assert resolve_plan(parse_config([*base, "--use-dpp", "--dpp-max-queued-ops", "2"], world_size=2), 2).schedule.max_queued_ops == 2
    # The default: unbounded without graphs (eager DPP was not measured with a bound)...
    assert resolve_plan(parse_config([*base, "--use-dpp"], world_size=2), 2).schedule.max_queued_ops == 0
