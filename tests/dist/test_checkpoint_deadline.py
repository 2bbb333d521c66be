"""Checkpoint saves never hang (house rule "never hang"): a rank stalled inside a save, as behind a
dead megatron-core writer worker or a wedged file system, makes every rank report where it waited
and exit 1 once the deadline passes (trainer/checkpoint/watchdog.py), instead of the job waiting
until Slurm's time limit. The unfinished save leaves no tracker for its iteration, and a resume
takes the previous checkpoint and carries on exactly as the failed run had trained.

The stall comes from the watchdog's test hook ($MDPP_TEST_CHECKPOINT_STALL); everything else is the
real trainer and megatron-core, on 2 ranks (PP=2, DPP runtime)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from tests.dist.checkpoints import TRACKER, assert_megatron_checkpoint
from tests.dist.launch import Ranks, start
from tests.dist.test_checkpoint_layouts import ARGS, train
from trainer.checkpoint.state import SAVE_WAIT, SAVE_WRITE
from trainer.checkpoint.watchdog import STALL_ENV, TIMEOUT_ENV

TIMEOUT_S = 8.0
MARGIN_S = 20.0  # the report, the stack dump and the exit, on a loaded 2-core machine
LAYOUT = ("--pipeline-model-parallel-size", "2", "--use-dpp", "--train-iters", "4")


def _wait_for_text(ranks: Ranks, rank: int, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in ranks.output(rank):
        if time.monotonic() > deadline or any(p.poll() is not None for p in ranks.procs):
            outputs = "\n".join(f"--- rank {r}\n{ranks.output(r)[-3000:]}" for r in range(len(ranks.procs)))
            ranks.wait(0)
            raise AssertionError(f"rank {rank} never printed {text!r}:\n{outputs}")
        time.sleep(0.2)


def _losses(out: Path) -> dict[int, float]:
    return {int(it): v["lm loss"] for it, v in json.loads((out / "losses_rank0.json").read_text()).items()}


@pytest.mark.timeout(300)
def test_a_save_stalled_on_one_rank_fails_every_rank_and_resume_takes_the_previous_checkpoint(
        tmp_path: Path) -> None:
    ckpt, stalled_out = tmp_path / "ckpt", tmp_path / "stalled"
    save = ("--save", str(ckpt), "--save-interval", "2")
    ranks = start(["tests.dist.train_harness", "--out", str(stalled_out), "--", *ARGS, *LAYOUT, *save], 2,
                  extra_env={TIMEOUT_ENV: str(TIMEOUT_S), STALL_ENV: f"1:save:4:{SAVE_WRITE}"})
    _wait_for_text(ranks, 1, f"stalling in phase '{SAVE_WRITE}'", timeout_s=240)
    stalled_at = time.monotonic()
    # megatron-core's writer Manager (spawned at the save of iteration 2) and anything else the ranks
    # started: the watchdog kills them, or they would outlive the ranks.
    children = [c for p in ranks.procs for c in psutil.Process(p.pid).children(recursive=True)]
    results = ranks.wait(TIMEOUT_S + MARGIN_S)  # kills (exit -9) what is still running then
    assert time.monotonic() - stalled_at < TIMEOUT_S + MARGIN_S
    detail = "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [1, 1], detail  # each exited by itself, non-zero
    for result, phase in zip(results, (SAVE_WAIT, SAVE_WRITE), strict=True):
        assert (f"checkpoint save timed out on rank {result.rank}: the save of iteration 4 "
                f"({ckpt / 'iter_0000004.tmp'}) did not finish within {TIMEOUT_S:g} s") in result.output, detail
        assert f"rank {result.rank} was waiting in phase '{phase}'" in result.output, detail
    assert not [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    # No tracker for the unfinished save: it still names iteration 2, and the leftover is not a checkpoint.
    assert (ckpt / TRACKER).read_text().strip() == "2"
    assert not (ckpt / "iter_0000004").exists() and (ckpt / "iter_0000004.tmp").is_dir()
    # What a save cut by SIGKILL at another iteration leaves (Slurm's, KillWait after the TERM the ranks
    # were saving on): an iteration the resumed run never saves again.
    (ckpt / "iter_0000003.tmp").mkdir()
    (ckpt / f"{TRACKER}.tmp123").write_text("3\n")
    # Resume: iteration 2's checkpoint, iterations 3-4 as the failed run trained them, and the next
    # save removes every leftover.
    resumed, output = train(tmp_path / "resumed", 2, *LAYOUT, *save, "--load", str(ckpt))
    assert "resuming at iteration 2" in output, output[-3000:]
    assert resumed == {it: loss for it, loss in _losses(stalled_out).items() if it > 2}
    assert_megatron_checkpoint(ckpt, 4)
    assert sorted(p.name for p in ckpt.iterdir() if ".tmp" in p.name) == []
