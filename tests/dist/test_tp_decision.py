"""TP decisions on real processes (trainer/pipeline/tp_decision.py): rank 0 is the TP leader of one
stage, rank 1 its follower. The follower sleeps on the word log's futex word, so it wakes when the
leader publishes, costs no CPU while it waits, and reports a killed leader within a fraction of a
second instead of waiting for --dpp-timeout. conftest.py fails any test that leaves a segment of its own (/dev/shm/mdpp-<tag>*).
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch.distributed as dist

from tests.shm_tag import tagged
from trainer.launch.local_ranks import check_all_ok, run_processes
from trainer.names import tp_decision_name
from trainer.pipeline.tp_decision import TpDecisionChannel, TpDecisionTimeout, TpLeaderDied
from trainer.schedule.core import Action, Op

STEPS = [[Action(Op.F, m, 0) for m in range(4)] + [Action(Op.B, m, 0) for m in range(4)],
         [Action(Op.F, 0, 1), Action(Op.W, 3, 1), Action(Op.I, 2, 0)]]
PAUSE_S = 0.3  # the leader "decides" this long before some publishes: the follower is asleep then


def _channel(rank: int, job: str) -> TpDecisionChannel:
    return TpDecisionChannel(tp_decision_name(job, 0, 0), capacity=16, is_leader=rank == 0, group=None,
                             description=f"stage 0 rank {rank} (TP rank {rank})")


def _wake_up_scenario(rank: int, world: int, job: str) -> list:
    """Two steps; before every other publish the leader pauses, so the follower has gone to sleep."""
    channel = _channel(rank, job)
    out = []
    for actions in STEPS:
        channel.begin_step()
        dist.barrier()  # the follower must not see this step's words before it began the step
        for index, action in enumerate(actions):
            if rank == 0:
                if index % 2:
                    time.sleep(PAUSE_S)
                out.append(time.monotonic())  # CLOCK_MONOTONIC: one clock for every process of the host
                channel.publish(index, action)
            else:
                cpu, start = time.process_time(), time.monotonic()
                got = channel.read(index, timeout_s=30.0)
                out.append((got, time.monotonic(), time.monotonic() - start, time.process_time() - cpu))
        dist.barrier()  # the leader rewrites the slots next step only after every read
    channel.close()
    return out


@pytest.mark.timeout(90)
def test_follower_wakes_when_the_leader_publishes_and_sleeps_meanwhile():
    published, received = check_all_ok(run_processes(_wake_up_scenario, 2, tagged(uuid.uuid4().hex[:8])))
    assert [r[0] for r in received] == [a for actions in STEPS for a in actions]
    for index, (at, (_, woke, waited, cpu)) in enumerate(zip(published, received, strict=True)):
        assert woke - at < 0.05, f"decision {index}: woke {woke - at:.4f}s after the publish"
        if waited > PAUSE_S / 2:  # slept through the leader's pause: a futex wait, not a spin
            assert cpu < 0.05, f"decision {index}: waiting {waited:.2f}s used {cpu:.3f}s of CPU"
    assert sum(r[2] > PAUSE_S / 2 for r in received) >= 4, received  # the pauses were waited through


def _killed_leader_scenario(rank: int, world: int, job: str) -> tuple[int, str, str, float]:
    """The leader publishes decision 0 and is SIGKILLed 0.3 s later; the follower waits for decision 1
    with a 30 s timeout."""
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    channel = _channel(rank, job)
    channel.begin_step()
    if rank == 0:
        channel.publish(0, Action(Op.F, 0, 0))
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    assert channel.read(0, timeout_s=30.0) == Action(Op.F, 0, 0)
    start = time.monotonic()
    try:
        channel.read(1, timeout_s=30.0)
    except TpLeaderDied as exc:
        return pids[0], type(exc).__name__, str(exc), time.monotonic() - start
    finally:
        channel.close()
    raise AssertionError("read returned a decision the dead leader never made")


@pytest.mark.timeout(90)
def test_a_killed_leader_is_reported_within_a_second_naming_it():
    leader, follower = run_processes(_killed_leader_scenario, 2, tagged(uuid.uuid4().hex[:8]))
    assert leader.exitcode == -signal.SIGKILL, leader
    pid, kind, message, elapsed = check_all_ok([follower])[0]
    assert kind == "TpLeaderDied" and elapsed < 2.0, (kind, message, elapsed)
    assert message == (f"stage 0 rank 1 (TP rank 1): TP rank 0 (rank 0, pid {pid}) died while this rank "
                       "waited for its decision #1 of step generation 1"), message


def _silent_leader_scenario(rank: int, world: int, job: str) -> tuple[str, float]:
    channel = _channel(rank, job)
    channel.begin_step()
    message, elapsed = "", 0.0
    if rank == 1:
        start = time.monotonic()
        with pytest.raises(TpDecisionTimeout) as info:
            channel.read(0, timeout_s=1.0)
        message, elapsed = str(info.value), time.monotonic() - start
    dist.barrier()
    channel.close()
    return message, elapsed


@pytest.mark.timeout(60)
def test_a_silent_leader_times_out_naming_the_wait():
    _, (message, elapsed) = check_all_ok(run_processes(_silent_leader_scenario, 2, tagged(uuid.uuid4().hex[:8])))
    assert 1.0 <= elapsed < 2.0, elapsed
    assert message.startswith("stage 0 rank 1 (TP rank 1): waited 1s for TP rank 0 (rank 0, pid "), message
    assert message.endswith("'s decision #0 of step generation 1"), message
