"""`python -m workflows.submit` on the real local cluster: whole chains, failures, status, requeue.

All chains of this module are submitted together when the first test asks for one (they share the
cluster's 2 x 8 declared CPUs; one after the other would only add scheduling latency and start-up
time), and each test then waits for its own. Every chain tokenizes the same small slice of the
shipped corpus, so preprocessing takes seconds and the uninterrupted GPT chain is the reference
the interrupted ones must match.

Two interruptions of a training job once it has logged iteration 8 (past the first periodic
checkpoint at 5), INTERRUPTIONS:

* `scontrol requeue` (abrupt, like preemption without warning): Slurm sends SIGTERM to every
  process and SIGKILL after KillWait; the job restarts under the same id and resumes from its last
  checkpoint.
* `scancel --batch --signal=USR1` (what `#SBATCH --signal=B:USR1@60` sends before a time limit):
  the sbatch file passes it to the ranks, which checkpoint and exit 0, then requeues its own job.

Here the first interrupts a chain's training job (CHAIN_INTERRUPTIONS): the chain's wait follows the
requeued job to the end and its aggregation runs after the second run. Both interrupt array tasks of
a sweep in tests/slurm/test_sweep_arrays.py (which imports them from here), each matched loss for
loss against an untouched sibling; on a plain job submitted by hand, tests/slurm/test_signals.py
checks both paths (the batch shell's own requeue, an on-signal save resumed with every loss equal).
A second interrupted chain for USR1 would check nothing those do not, for a sixth of this module's
time.

Slurm holds a requeued batch job for about two minutes before it may start again (EligibleTime);
the tests move that to now with `scontrol update StartTime=now` once the old run's processes are
gone (release_when_held says why it waits a little), which changes nothing about how the job
resumes and keeps CI from idling.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.corpus import small_corpus
from tests.timeouts import Budget, ceiling, communicate_within
from workflows import chain, slurm

REPO = Path(__file__).resolve().parents[2]
CHAIN_TIMEOUT_S = 900
"""A chain's budget on an unloaded machine: one chain alone takes ~1 min here, the module's five at once
on 2 cores ~5 min (CI: 2 cores, nothing else). Every wait stretches it by the load seen meanwhile
(tests/timeouts.py): two test runs at once (load ~7) make the same chains take ~3.5 times as long.
The driver's own --timeout is the stretched budget's ceiling, so the test's wait, which names what
it waited for and the state seen, comes first."""
INTERRUPT_AFTER = 8  # iterations logged before an interruption: past the first checkpoint (5)
INTERRUPTIONS = {
    "requeue": ["scontrol", "requeue"],
    "usr1": ["scancel", "--batch", "--signal=USR1"],
}
CHAIN_INTERRUPTIONS = ("requeue",)  # the ones done to a chain here (the module docstring says why)
ITERATION_LOSS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([0-9.eE+-]+)")


@dataclass
class SubmitResult:
    """What `python -m workflows.submit ... --wait` printed and left behind."""

    returncode: int
    stdout: str
    stderr: str
    job_ids: dict[str, str]
    run_dir: Path

    def describe(self) -> str:
        logs = ""
        for log in sorted((self.run_dir / "logs").glob("*.out")) if self.run_dir.name else []:
            logs += f"\n---- {log.name}\n{log.read_text()[-3000:]}"
        return f"exit {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}{logs}"

    def log(self, step: str) -> str:
        return (self.run_dir / "logs" / f"mdpp-{self.run_dir.name}-{step}_{self.job_ids[step]}.out").read_text()

    def states(self) -> dict[str, str]:
        records = {r.job_id: r.state for r in slurm.query(job_ids=list(self.job_ids.values()))}
        return {step: records.get(job_id, "MISSING") for step, job_id in self.job_ids.items()}


def start_submit(runs_dir: Path, corpus: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "workflows.submit", *args, "--wait", "--timeout", str(ceiling(CHAIN_TIMEOUT_S)),
            "--runs-dir", str(runs_dir), "--env", f"INPUT={corpus}"]
    return subprocess.Popen(argv, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_submit(proc: subprocess.Popen) -> SubmitResult:
    """Wait for `submit --wait` (CHAIN_TIMEOUT_S, stretched by the load); past it, fail with what it
    printed so far (its jobs and the states --wait saw)."""
    stdout, stderr = communicate_within(proc, CHAIN_TIMEOUT_S + 60,
                                        f"`submit {' '.join(map(str, proc.args[3:]))[:300]}` to return")
    job_ids = dict(re.findall(r"^(preprocess|train|aggregate)\s+job (\d+)$", stdout, re.M))
    logs = re.search(r"^logs:\s+(\S+)$", stdout, re.M)
    run_dir = Path(logs.group(1)).parent if logs else Path()
    return SubmitResult(proc.returncode, stdout, stderr, job_ids, run_dir)


def final_loss(train_log: str) -> tuple[int, str]:
    """(iteration, loss text) of the last iteration line the trainer logged."""
    found = ITERATION_LOSS.findall(train_log)
    assert found, f"no iteration/loss line in the training log:\n{train_log[-3000:]}"
    iteration, _total, loss = found[-1]
    return int(iteration), loss


def submit_without_wait(runs_dir: Path, corpus: Path) -> chain.Chain:
    done = subprocess.run([sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "2",
                           "--runs-dir", str(runs_dir), "--env", f"INPUT={corpus}"], cwd=REPO,
                          env=dict(os.environ), capture_output=True, text=True, timeout=60, check=True)
    ids = dict(re.findall(r"^(preprocess|train|aggregate)\s+job (\d+)$", done.stdout, re.M))
    run_dir = Path(re.search(r"^logs:\s+(\S+)$", done.stdout, re.M).group(1)).parent
    return chain.Chain(ids, run_dir)


def train_log(submitted: chain.Chain) -> Path:
    return submitted.run_dir / "logs" / f"mdpp-{submitted.run_dir.name}-train_{submitted.job_ids['train']}.out"


def wait_for_iteration(log: Path, iteration: int, timeout_s: float, job_id: str = "") -> None:
    """Wait until the training log shows ``iteration``: ``timeout_s`` on an unloaded machine, stretched
    by the load (tests/timeouts.py); the failure names the job's state, the last iteration seen and
    the log's end."""
    budget, text = Budget(timeout_s, f"training ({log.name}) to log iteration {iteration}"), ""
    done: list[int] = []
    while not budget.expired():
        text = log.read_text() if log.exists() else ""
        done = [int(i) for i in re.findall(r"iteration\s+(\d+)/\s*\d+ \|", text)]
        if done and max(done) >= iteration:
            return
        time.sleep(0.2)
    seen = f"last iteration logged: {max(done) if done else 'none'}"
    if job_id:
        seen += f"; job {job_id} is {job_state(job_id)}"
    shown = slurm.call(["scontrol", "show", "job", job_id]).stdout if job_id else ""
    raise AssertionError(f"{budget.describe()}; {seen}\n{text[-3000:]}\n{shown}")


def wait_until(predicate, timeout_s: float, what: str, job_id: str = "") -> None:
    """Poll `predicate`; fail after `timeout_s` (stretched by the load, tests/timeouts.py), or as soon
    as job `job_id` has ended, naming its state."""
    budget, next_look = Budget(timeout_s, what), 0.0
    while not predicate():
        now = time.monotonic()
        assert not budget.expired(), (budget.describe()
                                      + (f" (job {job_id} is {job_state(job_id)})" if job_id else ""))
        if job_id and now >= next_look:
            state, next_look = job_state(job_id), now + 5
            assert state not in slurm.TERMINAL_STATES, f"job {job_id} ended {state} before {what}"
        time.sleep(0.2)


def job_state(job_id: str) -> str:
    records = slurm.query(job_ids=[job_id])
    return records[0].state if records else "PENDING"


def wait_until_started(job_id: str, timeout_s: float) -> None:
    """Wait for the job to leave PENDING: with five chains (or the rest of the suite) on two cores, its
    turn may take minutes, so a wait for its progress starts after this one."""
    wait_until(lambda: job_state(job_id) != "PENDING", timeout_s, f"job {job_id} to start", job_id)


def release_when_held(job_id: str, timeout_s: float) -> None:
    """Wait until the requeued job is pending again (its old run is gone), then make it eligible.

    Slurm's hold exists because the nodes revoke the old run's job credential, with one-second
    resolution, when it ends; a new run whose credential is stamped in that same second is killed
    as "credential revoked" (seen here when released at once). Two seconds stay clear of that.
    """
    budget, shown = Budget(timeout_s, f"requeued job {job_id} to be PENDING again"), ""
    while not budget.expired():
        shown = slurm.run(["scontrol", "show", "job", job_id])
        if "JobState=PENDING" in shown:
            time.sleep(2)
            slurm.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
            return
        time.sleep(0.5)
    state = re.search(r"JobState=(\S+)", shown)
    raise AssertionError(f"{budget.describe()}; last seen: JobState={state.group(1) if state else '?'}")


class Interrupter(threading.Thread):
    """Interrupts a chain's training job once it is past INTERRUPT_AFTER, then lets it restart."""

    def __init__(self, submitted: chain.Chain, command: list[str]):
        super().__init__(daemon=True)
        self.submitted, self.command = submitted, command
        self.error: BaseException | None = None

    def run(self) -> None:
        train_id = self.submitted.job_ids["train"]
        try:
            wait_until_started(train_id, timeout_s=CHAIN_TIMEOUT_S)
            wait_for_iteration(train_log(self.submitted), INTERRUPT_AFTER, CHAIN_TIMEOUT_S, train_id)
            slurm.run([*self.command, train_id])
            release_when_held(train_id, timeout_s=120)
        except BaseException as exc:  # re-raised by the test in the main thread
            self.error = exc


CHAINS = {
    "gpt": ["gpt", "--nodes", "2", "--partition", "debug"],
    "bert": ["bert", "--nodes", "2"],
    "bad_train_flag": ["gpt", "--nodes", "2", "--env", "EXTRA_TRAIN_ARGS=--no-such-flag"],
    "bad_tokenizer": ["gpt", "--nodes", "2", "--env", "TOKENIZER_TYPE=NoSuchTokenizer"],
}


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """Start every chain of this module at once.

    Yields ``(result, interrupted)``: ``result(name)`` waits for a `submit --wait` chain and caches
    it; ``interrupted[name]`` is (chain, its Interrupter thread) for each CHAIN_INTERRUPTIONS entry.
    """
    root = tmp_path_factory.mktemp("chains")
    corpus = small_corpus(root / "corpus.jsonl")
    procs = {name: start_submit(root / "runs", corpus, *args) for name, args in CHAINS.items()}
    interrupted = {}
    for name in CHAIN_INTERRUPTIONS:
        submitted = submit_without_wait(root / name, corpus)
        interrupted[name] = (submitted, Interrupter(submitted, INTERRUPTIONS[name]))
        interrupted[name][1].start()
    results: dict[str, SubmitResult] = {}

    def result(name: str) -> SubmitResult:
        if name not in results:
            results[name] = finish_submit(procs[name])
        return results[name]

    yield result, interrupted
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    for submitted, _thread in interrupted.values():
        slurm.call(["scancel", *submitted.ids])


def assert_trained_chain(result: SubmitResult, model: str) -> None:
    assert result.returncode == 0, result.describe()
    assert result.states() == {"preprocess": "COMPLETED", "train": "COMPLETED", "aggregate": "COMPLETED"}
    assert "chain COMPLETED" in result.stdout
    # --wait showed the live states it went through, per job
    assert re.search(rf"train\s+{result.job_ids['train']} RUNNING", result.stdout), result.stdout
    suffix = "_text_sentence" if model == "bert" else "_text_document"
    dataset = result.run_dir / "data" / ("bert" if model == "bert" else "gpt2") / f"sample{suffix}"
    assert dataset.with_suffix(".bin").stat().st_size > 0 and dataset.with_suffix(".idx").stat().st_size > 0
    checkpoints = [p for p in (result.run_dir / "checkpoints").rglob("*") if p.is_file()]
    assert checkpoints, f"no checkpoint under {result.run_dir / 'checkpoints'}"
    traces = result.run_dir / "traces"
    assert len(list(traces.glob("trace_rank*.json"))) == 2  # one per rank: PP=2 over 2 nodes
    merged = json.loads((traces / "merged.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"} == {0, 1}  # both stages
    summary = json.loads((traces / "summary.json").read_text())
    assert (summary["missing_ranks"], len(summary["iterations"])) == ([], 20)
    assert (traces / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    iteration, _loss = final_loss(result.log("train"))
    assert iteration == 20


@pytest.mark.timeout(ceiling(CHAIN_TIMEOUT_S) + 120)
@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_submit_wait_completes_the_whole_chain(chains, model):
    result, _ = chains
    assert_trained_chain(result(model), model)


@pytest.mark.timeout(ceiling(CHAIN_TIMEOUT_S) + 120)
def test_status_shows_the_chain_from_any_job_id(chains):
    result = chains[0]("gpt")
    assert result.returncode == 0, result.describe()
    for step in ("preprocess", "aggregate"):
        status = subprocess.run([sys.executable, "-m", "workflows.status", result.job_ids[step]], cwd=REPO,
                                capture_output=True, text=True, timeout=60, check=False)
        assert status.returncode == 0, status.stderr
        rows = [line.split() for line in status.stdout.splitlines()[1:4]]
        assert [(r[0], r[2]) for r in rows] == [(result.job_ids[s], "COMPLETED") for s in
                                                ("preprocess", "train", "aggregate")]
        assert status.stdout.rstrip().endswith("chain: COMPLETED")


@pytest.mark.timeout(ceiling(CHAIN_TIMEOUT_S) + 120)
def test_a_failing_training_job_fails_the_chain_fast_and_aggregation_still_reports(chains):
    result = chains[0]("bad_train_flag")
    assert result.returncode == 1, result.describe()
    states = result.states()
    assert (states["preprocess"], states["train"]) == ("COMPLETED", "FAILED"), result.describe()
    assert states["aggregate"] in {"COMPLETED", "FAILED"}  # it ran: afterany
    train = next(r for r in slurm.query(job_ids=[result.job_ids["train"]]))
    hours, minutes, seconds = (int(x) for x in train.elapsed.split(":"))
    assert hours * 3600 + minutes * 60 + seconds < 60, f"training job took {train.elapsed} to fail"
    assert "--no-such-flag" in result.log("train")
    assert "aggregate: traces found in" in result.log("aggregate")
    assert "chain failed: train" in result.stderr


@pytest.mark.timeout(ceiling(CHAIN_TIMEOUT_S) + 120)
def test_a_failing_preprocessing_job_cancels_training_and_aggregation_still_runs(chains):
    result = chains[0]("bad_tokenizer")
    assert result.returncode == 1, result.describe()
    states = result.states()
    assert states["preprocess"] == "FAILED" and states["train"] == "CANCELLED", result.describe()
    assert states["aggregate"] in {"COMPLETED", "FAILED"}  # afterany of a cancelled job still runs
    assert "aggregate: traces found in" in result.log("aggregate")


@pytest.mark.timeout(120)
def test_status_of_an_unknown_job_is_one_line_and_status_2():
    started = time.monotonic()
    status = subprocess.run([sys.executable, "-m", "workflows.status", "999999"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=False)
    assert (status.returncode, status.stderr.strip()) == (
        2, "python -m workflows.status: error: job 999999: not found in sacct")
    assert time.monotonic() - started < 30


@pytest.mark.timeout(ceiling(3 * CHAIN_TIMEOUT_S) + 300)
@pytest.mark.parametrize("interruption", CHAIN_INTERRUPTIONS)
def test_interrupted_training_resumes_and_matches_an_uninterrupted_run(chains, interruption):
    result, interrupted = chains
    submitted, interrupter = interrupted[interruption]
    train_id = submitted.job_ids["train"]
    interrupter.join(timeout=ceiling(2 * CHAIN_TIMEOUT_S) + 180)  # its own waits are stretched budgets
    assert not interrupter.is_alive(), "the interrupter thread did not finish"
    if interrupter.error is not None:
        raise interrupter.error
    final = chain.wait(submitted, Budget(CHAIN_TIMEOUT_S, "").allowed_s, on_change=lambda record, step: None)
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
    reference = result("gpt")
    assert reference.returncode == 0, reference.describe()
    assert final_loss(second_run) == final_loss(reference.log("train"))
    assert final_loss(second_run)[0] == 20
