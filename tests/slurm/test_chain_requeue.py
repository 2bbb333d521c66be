"""A training job requeued mid-run resumes from its checkpoint and ends where an uninterrupted run does.

`scontrol requeue` stops the job the way preemption does (SIGTERM to every process, SIGKILL after
KillWait): the ranks checkpoint on the signal, Slurm requeues the job with the same id, and the
sbatch file's --load resumes it. Slurm holds a requeued batch job for about two minutes before it
may start again (its EligibleTime); the test moves that to now with `scontrol update StartTime=now`
so that CI does not sit idle, which changes nothing about how the job resumes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.test_chain import CHAIN_TIMEOUT_S, final_loss, finish_submit, small_corpus, start_submit
from workflows import chain, slurm

REPO = Path(__file__).resolve().parents[2]
TRAIN_ITERS = 60  # long enough to interrupt reliably after the first periodic checkpoint (5)


def submit_without_wait(runs_dir: Path, corpus: Path) -> chain.Chain:
    done = subprocess.run([sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "2",
                           "--train-iters", str(TRAIN_ITERS), "--runs-dir", str(runs_dir),
                           "--env", f"INPUT={corpus}"], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=60, check=True)
    ids = dict(re.findall(r"^(preprocess|train|aggregate)\s+job (\d+)$", done.stdout, re.M))
    run_dir = Path(re.search(r"^logs:\s+(\S+)$", done.stdout, re.M).group(1)).parent
    return chain.Chain(ids, run_dir)


def train_log(submitted: chain.Chain) -> Path:
    return submitted.run_dir / "logs" / f"mdpp-{submitted.run_dir.name}-train_{submitted.job_ids['train']}.out"


def wait_for_iteration(log: Path, iteration: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        done = [int(i) for i, _total, _loss in re.findall(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: (\S+)", text)]
        if done and max(done) >= iteration:
            return
        time.sleep(0.2)
    raise AssertionError(f"training never logged iteration {iteration} within {timeout_s:.0f} s:\n{text[-3000:]}")


def release_when_held(job_id: str, timeout_s: float) -> None:
    """Wait for the requeued job to be pending again, then make it eligible now."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                               timeout=30, check=True).stdout
        if "JobState=PENDING" in shown:
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], timeout=30, check=True)
            return
        time.sleep(0.5)
    raise AssertionError(f"requeued job {job_id} never became PENDING within {timeout_s:.0f} s")


@pytest.mark.timeout(2 * CHAIN_TIMEOUT_S)
def test_requeued_training_resumes_and_matches_an_uninterrupted_run(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    reference = start_submit(tmp_path / "reference", corpus, "gpt", "--nodes", "2",
                             "--train-iters", str(TRAIN_ITERS))
    submitted = submit_without_wait(tmp_path / "interrupted", corpus)
    train_id = submitted.job_ids["train"]
    try:
        wait_for_iteration(train_log(submitted), 8, timeout_s=CHAIN_TIMEOUT_S)
        subprocess.run(["scontrol", "requeue", train_id], timeout=30, check=True)
        release_when_held(train_id, timeout_s=60)
        final = chain.wait(submitted, CHAIN_TIMEOUT_S, on_change=lambda record, step: None)
    finally:
        subprocess.run(["scancel", *submitted.ids], timeout=30, check=False)
    log = train_log(submitted).read_text()
    assert [r.state for r in final] == ["COMPLETED"] * 3, log[-4000:]
    saved = re.findall(r"saved checkpoint at iteration (\d+) on signal", log)
    assert saved, f"the ranks did not checkpoint on the requeue signal:\n{log[-4000:]}"
    assert "restart 1" in log  # the second run of the same job id
    resumed = [int(i) for i in re.findall(r"resuming at iteration (\d+)", log)]
    assert resumed[-1] == int(saved[-1]) > 0, log[-4000:]
    history = slurm.run(["sacct", "-D", "-X", "-n", "-P", "-j", train_id, "--format=State"]).split()
    assert history[0] == "REQUEUED" and history[-1] == "COMPLETED", history

    ref = finish_submit(reference)
    assert ref.returncode == 0, ref.describe()
    assert final_loss(log) == final_loss(ref.log("train")) == (TRAIN_ITERS, final_loss(log)[1])
