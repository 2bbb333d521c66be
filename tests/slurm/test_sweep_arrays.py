"""Sweeps on the real local cluster, the harder paths: a sweep split over several job
arrays, an array task requeued in mid-training, and a failed array task's report.

The module's three sweeps are submitted together (`submit --sweep ... --wait`, each in its own runs
folder) when the first test asks for one, and each test waits for its own:

* ``arrays``: ``--sweep pp=2,4 --sweep schedule=1f1b,dpp`` on 2 nodes. PP=2 runs 1 rank per node,
  PP=4 runs 2: two allocations, so two job arrays of two tasks each, one preprocessing job whose
  dataset all four runs read, and one aggregation per run. (It is also the tier's plain sweep: a
  separate two-run sweep would check the same things again for another minute of the cluster.)
* ``requeue``: ``--sweep save_interval=5,4,3`` (20 iterations; the checkpoint interval does not
  change the numbers). Once they have logged iteration 8, task 0 is requeued with ``scontrol requeue
  <array>_0`` (preemption) and task 2 gets ``scancel --batch --signal=USR1 <array>_2`` (the time
  limit's warning), as tests/slurm/test_chain.py does to a chain's training job; task 1 runs
  undisturbed and is the uninterrupted reference.
* ``failing``: ``--sweep NUM_ATTENTION_HEADS=4,3``: hidden size 64 does not split into 3 heads, so
  task 1 fails in the trainer's configuration check while task 0 completes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.slurm.test_chain import (
    INTERRUPT_AFTER,
    INTERRUPTIONS,
    REPO,
    final_loss,
    release_when_held,
    small_corpus,
    wait_for_iteration,
    wait_until_started,
)
from tests.timeouts import Budget, ceiling, communicate_within
from workflows import slurm, sweep

SWEEP_TIMEOUT_S = 900
"""A sweep's budget on an unloaded machine (the three sweeps share 2 cores and the cluster's 16 declared
CPUs: their ~22 ranks start at once, each importing megatron-core). Every wait stretches it by the
load seen meanwhile (tests/timeouts.py); the driver's --timeout is the stretched budget's ceiling."""
INTERRUPTED = {0: "requeue", 2: "usr1"}  # task -> tests/slurm/test_chain.py's INTERRUPTIONS
SWEEPS = {
    "arrays": ["--sweep", "pp=2,4", "--sweep", "schedule=1f1b,dpp", "--train-iters", "4"],
    "requeue": ["--sweep", "save_interval=5,4,3"],
    "failing": ["--sweep", "NUM_ATTENTION_HEADS=4,3", "--train-iters", "4"],
}


class SweepRun:
    """One `submit --sweep --wait` process and what it leaves in its own runs folder."""

    def __init__(self, runs_dir: Path, corpus: Path, args: list[str]):
        self.runs_dir = runs_dir
        argv = [sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "2", *args, "--env", f"INPUT={corpus}",
                "--runs-dir", str(runs_dir), "--wait", "--timeout", str(ceiling(SWEEP_TIMEOUT_S))]
        self.proc = subprocess.Popen(argv, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.returncode: int | None = None
        self.stdout = self.stderr = ""

    def manifest(self, timeout_s: float = 120) -> dict:
        """sweep.json, once the driver has written it (right after submitting)."""
        budget = Budget(timeout_s, f"{sweep.MANIFEST} under {self.runs_dir}")
        while not budget.expired():
            found = list(self.runs_dir.glob(f"*/{sweep.MANIFEST}"))
            if found:
                try:
                    return sweep.read_manifest(found[0])
                except ValueError:  # caught mid-write
                    pass
            time.sleep(0.5)
        raise AssertionError(f"{budget.describe()}; driver {'running' if self.proc.poll() is None else 'ended'}")

    def finish(self) -> SweepRun:
        if self.returncode is None:
            self.stdout, self.stderr = communicate_within(
                self.proc, SWEEP_TIMEOUT_S + 60, f"`submit --sweep --wait` of {self.runs_dir.name} to return",
                state=self.job_states)
            self.returncode = self.proc.returncode
        return self

    def job_states(self) -> str:
        """Every job of the sweep and its state now (for a failure's message)."""
        try:
            return str(states(self.manifest(timeout_s=1)))
        except AssertionError:
            return f"no {sweep.MANIFEST} yet"

    def describe(self) -> str:
        logs = ""
        for log in sorted(self.runs_dir.glob("*/logs/*.out")):
            logs += f"\n---- {log.name}\n{log.read_text()[-3000:]}"
        return f"exit {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}{logs}"


class TaskInterrupter(threading.Thread):
    """Interrupts one array task of a sweep once it is past INTERRUPT_AFTER, then lets it restart."""

    def __init__(self, run: SweepRun, point: int, command: list[str]):
        super().__init__(daemon=True)
        self.run_, self.point, self.command = run, point, command
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            manifest = self.run_.manifest()
            task = manifest["points"][self.point]["train"]
            # The task may queue for minutes behind the other sweeps' runs (the cluster's CPUs are all
            # taken), longer under load: its progress is timed from its start, as a chain's is.
            wait_until_started(task, timeout_s=SWEEP_TIMEOUT_S)
            wait_for_iteration(sweep.log_path(manifest, "train", task), INTERRUPT_AFTER, timeout_s=SWEEP_TIMEOUT_S,
                               job_id=task)
            slurm.run([*self.command, task])
            release_when_held(task, timeout_s=120)  # stretched by the load, as every wait here
        except BaseException as exc:  # re-raised by the test in the main thread
            self.error = exc


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeps")
    corpus = small_corpus(root / "corpus.jsonl")
    runs = {name: SweepRun(root / name, corpus, args) for name, args in SWEEPS.items()}
    interrupters = {point: TaskInterrupter(runs["requeue"], point, INTERRUPTIONS[kind])
                    for point, kind in INTERRUPTED.items()}
    for thread in interrupters.values():
        thread.start()
    yield runs, interrupters
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()
            ids = sweep.job_ids(run.manifest(timeout_s=1)) if list(run.runs_dir.glob("*/sweep.json")) else []
            slurm.call(["scancel", *ids])


def status(job_id: str, runs_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflows.status", job_id, "--runs-dir", str(runs_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def history(job_id: str) -> list[str]:
    """Every run's state of a job, oldest first (sacct -D: a requeued run's REQUEUED record too)."""
    return slurm.run(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "--format=State"]).split()


def states(manifest: dict) -> dict[str, str]:
    records = sweep.records_by_id(slurm.query(job_ids=sweep.job_ids(manifest)))
    return {job_id: sweep.state_of(records, job_id) for job_id in sweep.job_ids(manifest)}


@pytest.mark.timeout(ceiling(2 * SWEEP_TIMEOUT_S))
def test_a_sweep_over_allocations_runs_as_several_arrays_and_status_shows_every_run(sweeps):
    run = sweeps[0]["arrays"].finish()
    assert run.returncode == 0, run.describe()
    assert "sweep COMPLETED" in run.stdout, run.describe()
    manifest = run.manifest()
    points = manifest["points"]
    assert [p["description"] for p in points] == [
        "pp=2 schedule=1f1b", "pp=2 schedule=dpp", "pp=4 schedule=1f1b", "pp=4 schedule=dpp"]
    # Two allocations (1 and 2 ranks per node): two arrays, each with tasks 0 and 1.
    arrays = [p["train"].split("_") for p in points]
    assert all(len(a) == 2 for a in arrays), points
    assert arrays[0][0] == arrays[1][0] != arrays[2][0] == arrays[3][0], points
    assert [a[1] for a in arrays] == ["0", "1", "0", "1"], points
    assert len({p["aggregate"] for p in points}) == 4, points  # one aggregation per run
    assert set(states(manifest).values()) == {"COMPLETED"}, states(manifest)
    # One dataset, written once into the sweep's folder, read by every run; each run has its own folder.
    (sweep_dir,) = run.runs_dir.iterdir()
    assert list((sweep_dir / "data").rglob("*.bin")), sorted(sweep_dir.rglob("*"))
    for point in points:
        pp, schedule = int(point["overrides"]["PP"]), point["config"]["schedule"]
        run_dir = Path(point["run_dir"])
        assert (run_dir.parent, run_dir.name) == (sweep_dir, f"pp-{pp}_schedule-{schedule}"), point
        assert not (run_dir / "data").exists()
        traces = run_dir / "traces"
        summary = json.loads((traces / "summary.json").read_text())
        assert (summary["schedule"], summary["pipeline_parallel"], len(summary["iterations"])) == \
            (schedule, pp, 4), summary
        assert len(list(traces.glob("trace_rank*.json"))) == pp  # one per rank, PP ranks
        train_log = sweep.log_path(manifest, "train", point["train"]).read_text()  # <array>_<task>.out
        assert f"{pp} ranks" in train_log, train_log[-2000:]
        assert "aggregate: traces found in" in sweep.log_path(manifest, "aggregate", point["aggregate"]).read_text()

    # workflows.status from a task of either array, an aggregation or the preprocessing id: the table.
    for job_id in (points[0]["train"], points[3]["train"], points[1]["aggregate"], manifest["preprocess"]):
        shown = status(job_id, run.runs_dir)
        assert shown.returncode == 0, (job_id, shown.stdout, shown.stderr)
        assert shown.stdout.splitlines()[1].split() == [
            "configuration", "train", "state", "aggregate", "ms/iter", "bubble"], shown.stdout
        rows = shown.stdout.splitlines()[2:6]
        for line, point in zip(rows, points, strict=True):
            assert re.match(rf"{point['description']}\s+{point['train']}\s+COMPLETED\s+COMPLETED\s+"
                            r"\d+\.\d\s+0\.\d{4}$", line), shown.stdout
        assert shown.stdout.splitlines()[-1] == "sweep: COMPLETED"
    # Without the runs folder it cannot find the manifest, and says what to pass.
    lost = status(points[0]["aggregate"], run.runs_dir.parent)
    assert lost.returncode == 2 and "--runs-dir" in lost.stderr, lost.stderr


@pytest.mark.timeout(ceiling(2 * SWEEP_TIMEOUT_S))
def test_interrupted_array_tasks_resume_and_match_their_undisturbed_sibling(sweeps):
    runs, interrupters = sweeps
    run = runs["requeue"].finish()
    for thread in interrupters.values():
        thread.join(timeout=ceiling(60))
        assert not thread.is_alive(), "an interrupter thread did not finish"
        if thread.error is not None:
            raise thread.error
    assert run.returncode == 0, run.describe()
    assert "sweep COMPLETED" in run.stdout, run.describe()
    manifest = run.manifest()
    points = manifest["points"]
    assert set(states(manifest).values()) == {"COMPLETED"}, states(manifest)

    # The sibling task was not touched: one run, no requeue, all 20 iterations.
    other = points[1]
    sibling = sweep.log_path(manifest, "train", other["train"]).read_text()
    assert history(other["train"]) == ["COMPLETED"], history(other["train"])
    assert re.findall(r", restart (\d+)\n", sibling) == ["0"], sibling[-3000:]
    assert set(re.findall(r"resuming at iteration (\d+)", sibling)) == {"0"}, sibling[-3000:]
    assert final_loss(sibling)[0] == 20
    summary = json.loads((Path(other["run_dir"]) / "traces" / "summary.json").read_text())
    assert len(summary["iterations"]) == 20

    for index, kind in INTERRUPTED.items():
        task = points[index]["train"]
        log = sweep.log_path(manifest, "train", task).read_text()
        first_run, _, second_run = log.partition(", restart 1\n")
        assert second_run, f"task {task} ({kind}) did not run a second time:\n{log[-4000:]}"
        checkpoints = [int(i) for i in re.findall(r"saved checkpoint at iteration (\d+)", first_run)]
        resumed = [int(i) for i in re.findall(r"resuming at iteration (\d+)", second_run)]
        assert checkpoints and resumed and resumed[0] == max(checkpoints) >= 3, (kind, log[-4000:])
        if kind == "usr1":  # the time-limit warning: checkpoint on the signal, the file requeues the task
            assert re.search(r"saved checkpoint at iteration \d+ on signal", first_run), first_run[-3000:]
            # ... as <array>_<task>: task 2's own job id is the array's, which requeued every task
            assert f"requeueing job {task} " in first_run, first_run[-3000:]
        assert history(task)[0] == "REQUEUED" and history(task)[-1] == "COMPLETED", (kind, history(task))
        # The resumed run ends where the uninterrupted one does, loss for loss.
        assert final_loss(second_run) == final_loss(sibling), kind


@pytest.mark.timeout(ceiling(2 * SWEEP_TIMEOUT_S))
def test_a_failed_array_task_is_reported_with_its_log_tail_and_remote_traceback(sweeps):
    run = sweeps[0]["failing"].finish()
    assert run.returncode == 1, run.describe()
    manifest = run.manifest()
    good, bad = manifest["points"]
    found = states(manifest)
    assert (found[good["train"]], found[good["aggregate"]], found[bad["train"]]) == \
        ("COMPLETED", "COMPLETED", "FAILED"), found
    assert bad["train"].endswith("_1")

    def assert_reported(text: str) -> None:
        assert re.search(rf"^train NUM_ATTENTION_HEADS=3 job {bad['train']}: FAILED, exit code [1-9]\d*:0$",
                         text, re.M), text
        assert f"lines of {sweep.log_path(manifest, 'train', bad['train'])}:" in text, text
        assert "--hidden-size=64 is not divisible by --num-attention-heads=3" in text, text  # the log tail
        assert "remote traceback (submitit):" in text, text
        assert re.search(r"StepFailed: train: `bash \S+` exited [1-9][0-9]*", text), text
        assert f"job {good['train']}:" not in text  # only what failed is reported

    assert_reported(run.stderr)
    assert "sweep failed: logs in" in run.stderr
    assert re.search(rf"^NUM_ATTENTION_HEADS=4\s+{good['train']}\s+COMPLETED\s+COMPLETED\s", run.stdout, re.M)
    assert re.search(rf"^NUM_ATTENTION_HEADS=3\s+{bad['train']}\s+FAILED\s", run.stdout, re.M), run.stdout

    shown = status(bad["train"], run.runs_dir)
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert_reported(shown.stdout)
    assert shown.stdout.rstrip().endswith("sweep: FAILED")
