"""A rank killed with ``kill -9`` under srun (the OOM killer, a node's watchdog, a user): the step and
the job end within seconds, FAILED, with no process of the job left, and the job's log names the dead
rank and its node.

Before: the surviving rank failed within a second, but the step took another ~60 s (slurmstepd
"Abandoning IO 60 secs after job shutdown": the helper processes of megatron-core's checkpoint
writer, orphaned and reparented to init, held the step's output pipes), the job's last line said only
"no exit record", and four of those helpers outlived the job and ``scripts/cluster.sh down``.
The rank is killed after the first periodic checkpoint, so the checkpoint writer has run.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.slurm.test_signals import PERIODIC_SAVE, dataset, last_iteration, submit_training, wait_until  # noqa: F401
from workflows import slurm

ENDS_WITHIN_S = 20.0
TRAIN_ITERS = 100  # killed a few iterations in: the rest only leave room for the kill (~0.3 s an iteration alone)


def processes_of(job_id: str) -> dict[int, str]:
    """pid -> command line of every process on this host that belongs to the job (Slurm puts
    SLURM_JOB_ID in the environment of everything a job starts; the cluster's nodes share this host)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and cmdline:
            found[int(proc.name)] = cmdline
    return found


def rank_process(job_id: str, rank: int) -> int:
    for pid in processes_of(job_id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if f"SLURM_PROCID={rank}".encode() in environ and comm.startswith("python") \
                and "trainer.train" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no training process of rank {rank} in job {job_id}: {processes_of(job_id)}")


@pytest.mark.timeout(900)
def test_a_rank_killed_hard_ends_the_job_in_seconds_leaving_nothing(dataset, tmp_path):  # noqa: F811
    job_id, log = submit_training(tmp_path / "run", dataset, TRAIN_ITERS)
    wait_until(lambda: log.exists() and PERIODIC_SAVE.search(log.read_text()) is not None
               and last_iteration(log) > int(PERIODIC_SAVE.search(log.read_text()).group(1)),
               600, "an iteration after the first periodic checkpoint")
    victim = rank_process(job_id, 1)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not slurm.run(["squeue", "-h", "-j", job_id]).strip(), 120, f"job {job_id} to end")
    took = time.monotonic() - killed
    text = log.read_text()
    assert took < ENDS_WITHIN_S, f"job {job_id} took {took:.1f} s to end after rank 1 was killed\n{text[-4000:]}"
    # slurmdbd records the end a moment after squeue drops the job: wait for the accounting row to end too
    wait_until(lambda: any(r.state in slurm.TERMINAL_STATES for r in slurm.query(job_ids=[job_id])), 60,
               f"sacct to record job {job_id}'s end")
    records = slurm.query(job_ids=[job_id])
    assert records and records[0].state == "FAILED", records
    time.sleep(1)
    assert processes_of(job_id) == {}, processes_of(job_id)
    assert "node2: task 1: Killed" in text, text[-4000:]  # srun: the dead rank and its node
    last = [line for line in text.splitlines() if line.startswith("train: training did not finish")]
    assert last and "rank 0 on node1" in last[-1] and "rank 1" in last[-1], text[-4000:]  # the survivor names the peer
