"""A training job interrupted mid-run resumes from its checkpoint and ends where an uninterrupted run does.

Two interruptions, each on its own chain, both compared with an uninterrupted chain of the same
recipe, data and seed:

* `scontrol requeue` (abrupt, like preemption without warning): Slurm sends SIGTERM to every
  process and SIGKILL after KillWait; the job restarts under the same id and resumes from its last
  checkpoint (periodic, or on the signal when the ranks reach one in time).
* `scancel --batch --signal=USR1` (what `#SBATCH --signal=B:USR1@60` sends before a time limit):
  the sbatch file passes it to the ranks, which checkpoint and exit 0, then requeues its own job.

Slurm holds a requeued batch job for about two minutes before it may start again (EligibleTime);
the test moves that to now with `scontrol update StartTime=now` once the old run's processes are
gone (release_when_held says why it waits a little), which changes nothing about how the job
resumes and keeps CI from idling.
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
INTERRUPT_AFTER = 8  # iterations logged before the interruption: past the first checkpoint (5)
INTERRUPTIONS = {
    "requeue": ["scontrol", "requeue"],
    "usr1": ["scancel", "--batch", "--signal=USR1"],
}


def submit_without_wait(runs_dir: Path, corpus: Path) -> chain.Chain:
    done = subprocess.run([sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "2",
                           "--runs-dir", str(runs_dir), "--env", f"INPUT={corpus}"], cwd=REPO,
                          env=dict(os.environ), capture_output=True, text=True, timeout=60, check=True)
    ids = dict(re.findall(r"^(preprocess|train|aggregate)\s+job (\d+)$", done.stdout, re.M))
    run_dir = Path(re.search(r"^logs:\s+(\S+)$", done.stdout, re.M).group(1)).parent
    return chain.Chain(ids, run_dir)


def train_log(submitted: chain.Chain) -> Path:
    return submitted.run_dir / "logs" / f"mdpp-{submitted.run_dir.name}-train_{submitted.job_ids['train']}.out"


def wait_for_iteration(log: Path, iteration: int, timeout_s: float) -> None:
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        done = [int(i) for i in re.findall(r"iteration\s+(\d+)/\s*\d+ \|", text)]
        if done and max(done) >= iteration:
            return
        time.sleep(0.2)
    raise AssertionError(f"training never logged iteration {iteration} within {timeout_s:.0f} s:\n{text[-3000:]}")


def release_when_held(job_id: str, timeout_s: float) -> None:
    """Wait until the requeued job is pending again and its nodes are free, then make it eligible.

    Slurm's hold exists because the nodes revoke the old run's job credential, with one-second
    resolution, when it ends; a new run whose credential is stamped in that same second is killed
    as "credential revoked". Releasing two seconds after the nodes are idle stays clear of that.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending = "JobState=PENDING" in slurm.run(["scontrol", "show", "job", job_id])
        node_states = slurm.run(["sinfo", "-h", "-N", "-o", "%T"]).split()
        if pending and not any(state.startswith("completing") for state in node_states):
            time.sleep(2)
            slurm.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
            return
        time.sleep(0.5)
    raise AssertionError(f"requeued job {job_id} never became PENDING on idle nodes within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted reference chain, started once; ``submit(name)`` starts a chain to interrupt.

    Interrupted chains start one test at a time: each must be caught mid-run, which a chain that
    waited behind the others might not be.
    """
    root = tmp_path_factory.mktemp("requeue")
    corpus = small_corpus(root / "corpus.jsonl")
    reference = start_submit(root / "reference", corpus, "gpt", "--nodes", "2")
    submitted: list[chain.Chain] = []
    cache = {}

    def submit(name: str) -> chain.Chain:
        submitted.append(submit_without_wait(root / name, corpus))
        return submitted[-1]

    def reference_loss() -> tuple[int, str]:
        if "ref" not in cache:
            result = finish_submit(reference)
            assert result.returncode == 0, result.describe()
            cache["ref"] = final_loss(result.log("train"))
        return cache["ref"]

    yield submit, reference_loss
    for one in submitted:
        subprocess.run(["scancel", *one.ids], timeout=30, check=False)
    if reference.poll() is None:
        reference.kill()
        reference.communicate()


@pytest.mark.timeout(2 * CHAIN_TIMEOUT_S)
@pytest.mark.parametrize("interruption", list(INTERRUPTIONS))
def test_interrupted_training_resumes_and_matches_an_uninterrupted_run(runs, interruption):
    submit, reference_loss = runs
    submitted = submit(interruption)
    train_id = submitted.job_ids["train"]
    wait_for_iteration(train_log(submitted), INTERRUPT_AFTER, timeout_s=CHAIN_TIMEOUT_S)
    slurm.run([*INTERRUPTIONS[interruption], train_id])
    release_when_held(train_id, timeout_s=120)
    final = chain.wait(submitted, CHAIN_TIMEOUT_S, on_change=lambda record, step: None)
    log = train_log(submitted).read_text()
    assert [r.state for r in final] == ["COMPLETED"] * 3, log[-4000:]

    first_run, _, second_run = log.partition(", restart 1\n")
    assert second_run, f"the job did not run a second time:\n{log[-4000:]}"
    checkpoints = [int(i) for i in re.findall(r"saved checkpoint at iteration (\d+)", first_run)]
    resumed = [int(i) for i in re.findall(r"resuming at iteration (\d+)", second_run)]
    assert checkpoints and resumed and resumed[0] == max(checkpoints) >= 5, log[-4000:]
    if interruption == "usr1":  # the warning path must checkpoint on the signal itself
        assert re.search(r"saved checkpoint at iteration \d+ on signal", first_run), first_run[-3000:]
        assert f"requeueing job {train_id}" in first_run
    history = slurm.run(["sacct", "-D", "-X", "-n", "-P", "-j", train_id, "--format=State"]).split()
    assert history[0] == "REQUEUED" and history[-1] == "COMPLETED", history
    assert final_loss(second_run) == reference_loss()
    assert reference_loss()[0] == 20
