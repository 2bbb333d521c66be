"""What a same-layout resume restores besides the weights: the RNG streams (dropout
on: the resumed run draws the same masks, so its losses equal the straight run's exactly), and a
checkpoint saved before the first step (a signal during start-up) resumes like a fresh start, with
the plain and the distributed optimizer (torch's Adam keeps no state before its first step)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.dist.checkpoints import TRACKER, assert_megatron_checkpoint
from tests.dist.launch import start
from tests.dist.test_checkpoint_layouts import ARGS, straight_run_with_checkpoint_at_3, train

EXIT_STOPPED = 75


@pytest.mark.timeout(600)
def test_resume_restores_the_rng_streams(tmp_path: Path) -> None:
    """One rank, no pipeline: dropout masks come from one generator in a fixed order."""
    dropout = ("--hidden-dropout", "0.2", "--attention-dropout", "0.2")
    straight, ckpt = straight_run_with_checkpoint_at_3(tmp_path, 1, *dropout)
    resumed, output = train(tmp_path / "resumed", 1, *dropout, "--load", str(ckpt))
    assert "resuming at iteration 3" in output and sorted(resumed) == [4, 5, 6]
    assert {it: resumed[it] for it in (4, 5, 6)} == {it: straight[it] for it in (4, 5, 6)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", [(), ("--use-distributed-optimizer",)], ids=["plain", "distributed"])
def test_checkpoint_of_iteration_0_resumes_like_a_fresh_start(tmp_path: Path, optimizer: tuple[str, ...]) -> None:
    ckpt, ready = tmp_path / "ckpt", tmp_path / "ready"
    ready.mkdir()
    # As the batch script does (trainer/launch/early_signals.py): signal once the rank says its handlers are
    # in -- torch is still being imported then, so the stop comes before iteration 1. A fixed delay instead
    # (0.5 s) could land before Python ran at all on a loaded host, where USR1's default action kills.
    ranks = start(["trainer.train", *ARGS, *optimizer, "--save", str(ckpt)], 1,
                  extra_env={"MDPP_READY_DIR": str(ready)})
    deadline = time.monotonic() + 120
    while not (ready / "rank0").exists():
        assert ranks.procs[0].poll() is None, f"rank 0 ended before it was ready for signals:\n{ranks.output(0)[-3000:]}"
        assert time.monotonic() < deadline, "rank 0 did not report ready for signals within 120 s"
        time.sleep(0.05)
    ranks.procs[0].send_signal(signal.SIGUSR1)
    stopped = ranks.wait(300)[0]
    assert stopped.returncode == EXIT_STOPPED, stopped.output[-3000:]
    assert (ckpt / TRACKER).read_text().strip() == "0"
    assert_megatron_checkpoint(ckpt, 0)
    fresh, _ = train(tmp_path / "fresh", 1, *optimizer)
    resumed, output = train(tmp_path / "resumed", 1, *optimizer, "--load", str(ckpt))
    assert "resuming at iteration 0" in output and f"resumed from {ckpt / 'iter_0000000'}" in output
    assert resumed == fresh
