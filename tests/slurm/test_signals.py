"""Every way a training job can be interrupted ends it requeued or non-zero, never COMPLETED early.

The training sbatch file is submitted by hand (as a user would) on a dataset tokenized once here;
each job trains TRAIN_ITERS iterations and is interrupted in its own way:

* ``ranks-term``: ``scancel --signal=TERM`` reaches the ranks only. Before: they checkpointed and
  exited 0, and the job ended COMPLETED after a few of its iterations.
* ``full-term``: ``scancel --full --signal=TERM`` reaches the batch shell, srun and the ranks; srun
  then kills the ranks at once. Before and now: not COMPLETED (now also: no exit record, so non-zero).
* ``usr1-start-batch`` / ``usr1-start-ranks``: USR1 to the batch shell before srun runs, or to the
  ranks as soon as their step exists. Before: the ranks had no handler until set-up was done and
  died of it; the batch shell had no trap yet while it probed the node addresses. Now the shell's
  trap comes first and the ranks note the signal before importing torch; only the interpreter's own
  start (a fraction of a second) remains, where a rank still dies and the job ends FAILED, which
  the invariant below allows.

Whatever happens, a job that ends COMPLETED must have logged its last iteration; a requeued one is
released at once (tests/slurm/test_chain.py's release_when_held) and must then finish for real.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.test_chain import release_when_held, small_corpus
from workflows import slurm

REPO = Path(__file__).resolve().parents[2]
TRAIN_ITERS = 12
TIMEOUT_S = 600
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")


def last_iteration(log: Path) -> int:
    found = [int(i) for i in ITERATION.findall(log.read_text())] if log.exists() else []
    return max(found, default=0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("signals")
    corpus = small_corpus(root / "corpus.jsonl", 200)
    prefix = root / "data" / "sample"
    subprocess.run([sys.executable, "-m", "trainer.preprocess", "--input", str(corpus), "--output-prefix",
                    str(prefix), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "datasets/gpt2/vocab.json",
                    "--merge-file", "datasets/gpt2/merges.txt", "--append-eod"], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    return Path(f"{prefix}_text_document")


def submit_training(out: Path, dataset: Path) -> tuple[str, Path]:
    out.mkdir(parents=True)
    env = {**os.environ, "OUTPUT_DIR": str(out), "DATASET": str(dataset), "TRAIN_ITERS": str(TRAIN_ITERS),
           "SAVE_INTERVAL": "4"}
    job_id = slurm.sbatch(str(REPO / "sbatch" / "2.distributed-training.sbatch"),
                          ["--nodes=2", f"--output={out}/train_%j.out", f"--chdir={REPO}"], env)
    return job_id, out / f"train_{job_id}.out"


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def job_state(job_id: str) -> str:
    records = slurm.query(job_ids=[job_id])
    return records[0].state if records else "PENDING"


def follow_to_the_end(job_id: str, log: Path) -> tuple[str, int]:
    """Release the job whenever it is requeued; return its final state and how many restarts it had."""
    deadline, restarts = time.monotonic() + TIMEOUT_S, 0
    while time.monotonic() < deadline:
        shown = slurm.run(["scontrol", "show", "job", job_id]) if job_id else ""
        count = re.search(r"Restarts=(\d+)", shown)
        if count and int(count.group(1)) > restarts:
            restarts = int(count.group(1))
            release_when_held(job_id, timeout_s=120)
        state = job_state(job_id)
        if state in slurm.TERMINAL_STATES:
            return state, restarts
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish within {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def interrupt(kind: str, job_id: str, log: Path) -> None:
    if kind == "usr1-start-batch":  # the batch shell, before srun exists
        wait_until(lambda: job_state(job_id) == "RUNNING", 120, "the job to run")
        slurm.run(["scancel", "--batch", "--signal=USR1", job_id])
        return
    if kind == "usr1-start-ranks":  # the ranks, as soon as their step exists (still importing torch)
        wait_until(lambda: log.exists() and "restart 0" in log.read_text(), 120, "the srun line")
        wait_until(lambda: f"{job_id}." in slurm.run(["squeue", "--steps", "--noheader", "-j", job_id]),
                   120, "the training step")
        slurm.run(["scancel", "--signal=USR1", job_id])
        return
    wait_until(lambda: last_iteration(log) >= 3, TIMEOUT_S, "iteration 3")
    command = {"ranks-term": ["scancel", "--signal=TERM"], "full-term": ["scancel", "--full", "--signal=TERM"]}
    slurm.run([*command[kind], job_id])


@pytest.mark.timeout(TIMEOUT_S * 2)
@pytest.mark.parametrize("kind", ["ranks-term", "full-term", "usr1-start-batch", "usr1-start-ranks"])
def test_an_interrupted_training_job_is_never_completed_early(kind, dataset, tmp_path):
    job_id, log = submit_training(tmp_path / "run", dataset)
    interrupt(kind, job_id, log)
    state, restarts = follow_to_the_end(job_id, log)
    text = log.read_text()
    if state == "COMPLETED":
        assert last_iteration(log) == TRAIN_ITERS, text[-4000:]
        assert restarts >= 1, text[-4000:]  # it only completed through a requeue
    if kind in ("ranks-term", "usr1-start-batch"):  # a polite stop: checkpoint, requeue, resume, finish
        assert (state, "on signal" in text) == ("COMPLETED", True), f"{state}\n{text[-4000:]}"
    else:
        assert state != "COMPLETED" or restarts >= 1, f"{state}\n{text[-4000:]}"
