"""A rank that dies during set-up stops its peers within a bound, and each of them says what it waited
for; nothing of the run is left in /dev/shm. Real ``trainer.train`` ranks on one host.

- Rank 0 cannot listen for the rendezvous (its MASTER_PORT is held by another process, as a second
  run's connection once held it on a shared CI host): it fails at once, and its peers, left waiting
  for a store that never comes, give up within the rendezvous deadline, naming themselves and the
  address (trainer/launch/rendezvous.py).
- The same, with the product's default deadline (minutes): the launcher ends the peers a grace after
  rank 0 failed (trainer/launch/local_ranks.py; the tests' default grace, tests/dist/launch.py, is a
  fraction of that deadline) instead of sitting out the wait.
- A rank SIGKILLed after the rendezvous, in the middle of the set-up (tests/dist/setup_loss_harness.py):
  its peers' next collective breaks at once, and each names the step it was in
  (trainer/session/build.py, waiting_for_every_rank).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Callable

import pytest

from tests.dist.launch import PEER_REPORT_GRACE_S, Ranks, start
from tests.model_flags import model_flags
from tests.shm_tag import TAG
from tests.timeouts import MAX_STRETCH, Budget, ceiling
from trainer.launch.rendezvous import RENDEZVOUS_TIMEOUT_ENV, RENDEZVOUS_TIMEOUT_S
from trainer.names import is_segment_of

RENDEZVOUS_S = 20.0  # the peers' own deadline in the first test
GRACE_S = 10.0  # the launcher's grace in the second
SLACK_S = 30.0  # a rank's exit after its error, and the skew of the ranks' imports (idle machine)
START_S = 180.0  # importing megatron-core on every rank (idle 2-core machine: ~30 s for three)
ARGS = [*model_flags(seq=32, vocab=None), "--micro-batch-size", "1", "--train-iters", "1", "--use-dpp",
        "--transport", "shm", "--dpp-timeout", "30"]


def pipeline(stages: int) -> list[str]:
    return [*ARGS, "--pipeline-model-parallel-size", str(stages), "--num-layers", str(stages),
            "--global-batch-size", str(stages)]


def end_times(ranks: Ranks, idle_s: float, what: str,
              until: Callable[[dict[int, float]], bool] | None = None) -> dict[int, float]:
    """When each rank ended (time.monotonic), waiting at most ``idle_s`` (stretched by the load) for
    all of them, or for ``until(ended)``."""
    ended: dict[int, float] = {}
    budget = Budget(idle_s, what)
    done = until or (lambda ended: len(ended) == len(ranks.procs))
    while True:
        for rank, proc in enumerate(ranks.procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.monotonic()
        if done(ended):
            return ended
        if budget.expired():
            outputs = "\n".join(f"--- rank {r}\n{ranks.output(r)[-2000:]}" for r in range(len(ranks.procs)))
            ranks.wait(0)
            raise AssertionError(f"{budget.describe()}; ended so far: {sorted(ended)}\n{outputs}")
        time.sleep(0.1)


def held_port() -> socket.socket:
    """A socket bound to a loopback port, not listening: rank 0's store cannot bind there, and a
    connection to it is refused (as when another run's connection held rank 0's port)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    return holder


@pytest.mark.timeout(ceiling(START_S + RENDEZVOUS_S + SLACK_S) + 60)
def test_peers_of_a_rank_0_that_cannot_listen_give_up_within_the_rendezvous_deadline_naming_what_they_waited_for():
    with held_port() as holder:
        port = holder.getsockname()[1]
        ranks = start(["trainer.train", *pipeline(3)], 3,
                      extra_env={"MASTER_PORT": str(port), RENDEZVOUS_TIMEOUT_ENV: str(RENDEZVOUS_S)})
        ended = end_times(ranks, START_S + RENDEZVOUS_S + SLACK_S, "every rank to end by itself")
    results = ranks.wait(0)
    detail = "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [1, 1, 1], detail
    assert f"rank 0 could not listen at 127.0.0.1:{port}" in results[0].output, detail
    for peer in (1, 2):
        assert (f"rank {peer} waited {RENDEZVOUS_S:g} s for rank 0's rendezvous store at 127.0.0.1:{port}"
                in results[peer].output), detail
        # Within the deadline of rank 0's end, give or take the ranks' start-up skew: not the
        # process group's 600 s, nor the test launcher's deadline.
        late = Budget(RENDEZVOUS_S + SLACK_S, f"rank {peer} to give up after rank 0 failed")
        assert ended[peer] - ended[0] < late.allowed_s, (ended, late.describe(), detail)


def test_the_tests_grace_is_far_shorter_than_the_rendezvous_wait_it_cuts_short():
    assert PEER_REPORT_GRACE_S * MAX_STRETCH < RENDEZVOUS_TIMEOUT_S


@pytest.mark.timeout(ceiling(START_S + GRACE_S + SLACK_S) + 60)
def test_the_launcher_ends_peers_that_would_wait_minutes_a_grace_after_a_rank_failed():
    with held_port() as holder:
        port = holder.getsockname()[1]
        ranks = start(["trainer.train", *pipeline(2)], 2, extra_env={"MASTER_PORT": str(port)})
        ended = end_times(ranks, START_S, "rank 0 to fail", until=lambda ended: 0 in ended)
        results = ranks.wait(START_S, failure_grace_s=GRACE_S)  # the rule's mechanism, with a short grace
        took = time.monotonic() - ended[0]
    detail = "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [1, -signal.SIGKILL], detail
    assert f"rank 0 could not listen at 127.0.0.1:{port}" in results[0].output, detail
    assert "rendezvous store" not in results[1].output, detail  # killed while waiting, not by its own deadline
    assert GRACE_S <= took < GRACE_S + SLACK_S, (took, detail)


@pytest.mark.timeout(ceiling(START_S + SLACK_S) + 60)
def test_a_rank_killed_mid_setup_stops_its_peers_at_once_each_naming_its_step_and_leaves_nothing_in_dev_shm():
    ranks = start(["tests.dist.setup_loss_harness", "1", "--", *pipeline(3)], 3)
    ended = end_times(ranks, START_S + SLACK_S, "every rank to end")
    results = ranks.wait(0)
    detail = "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [1, -signal.SIGKILL, 1], detail
    tokens = {found for r in results for found in re.findall(r"^TOKEN (\S+)$", r.output, re.M)}
    assert len(tokens) == 1, (tokens, detail)
    (token,) = tokens
    assert token.startswith(TAG), token  # this test run's tag (tests/shm_tag.py): the run is ours
    for peer in (0, 2):
        assert (f"rank {peer} failed during set-up while gathering every rank's node (a collective with every "
                "rank)") in results[peer].output, detail
        # Broken at once by the dead peer's closed connections, not at the process group's timeout.
        soon = Budget(SLACK_S, f"rank {peer} to fail after rank 1 died")
        assert ended[peer] - ended[1] < soon.allowed_s, (ended, soon.describe(), detail)
    assert [name for name in os.listdir("/dev/shm") if is_segment_of(token, name)] == []
