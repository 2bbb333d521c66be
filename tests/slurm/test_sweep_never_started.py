"""Sweeps whose training array never starts, on the real local cluster (Slurm 22.05): sacct keeps no
row ``<array>_<task>`` for an array that never ran, only the array's one line ``<array>_[0-1]``.

* preprocessing fails (a corpus that is not JSON lines): --kill-on-invalid-dep cancels the array;
* the sweep is cancelled while its array is still pending on the preprocessing;
* one task is cancelled while pending and the other runs: then sacct has no line for it at all.

Either way `submit --sweep --wait` returns FAILED (not at its timeout) and names the dependency that
stopped the runs, and `workflows.status` of a task id that never ran says the same and exits 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.corpus import small_corpus
from tests.slurm.test_chain import REPO
from tests.timeouts import Budget, ceiling, communicate_within
from workflows import slurm, sweep

RETURN_WITHIN_S = 300
"""The sweep ends within seconds of its preprocessing (seconds of tokenizing here): the test's bound on
an unloaded 2-core machine, stretched by the load while it waits (tests/timeouts.py)."""
WAIT_TIMEOUT_S = ceiling(RETURN_WITHIN_S) + 300
"""--wait's own bound: beyond any stretch of RETURN_WITHIN_S, so a sweep that returns at its timeout
(the bug these tests guard against) can never pass."""


def start_sweep(runs_dir: Path, corpus: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "2", "--train-iters", "2",
            "--sweep", "schedule=1f1b,dpp", "--env", f"INPUT={corpus}", "--runs-dir", str(runs_dir),
            "--wait", "--timeout", str(WAIT_TIMEOUT_S)]
    return subprocess.Popen(argv, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def manifest_of(runs_dir: Path, proc: subprocess.Popen, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in runs_dir.glob(f"*/{sweep.MANIFEST}"):
            try:
                return sweep.read_manifest(path)
            except ValueError:  # caught mid-write
                pass
        if proc.poll() is not None:
            raise AssertionError(f"submit ended ({proc.returncode}) before writing {sweep.MANIFEST}: "
                                 f"{proc.communicate()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {sweep.MANIFEST} under {runs_dir} within {timeout_s:.0f} s")


def job_states(manifest: dict) -> str:
    """The preprocessing's and the array's states now, as sacct has them (for a failure's message)."""
    records = sweep.query(manifest)
    return ", ".join(f"{job} {sweep.state_of(records, job)}" for job in sweep.job_ids(manifest))


def finish(proc: subprocess.Popen, manifest: dict, budget: Budget | None = None) -> tuple[int, str, str]:
    """`submit --wait`'s status and output, within RETURN_WITHIN_S (stretched by the load), or within
    what is left of ``budget``; past it the sweep is cancelled and the failure names every job's state."""
    try:
        out, err = communicate_within(proc, budget or Budget(RETURN_WITHIN_S, "`submit --sweep --wait` to return"),
                                      state=lambda: job_states(manifest))
    except AssertionError:
        slurm.call(["scancel", *sweep.query_ids(sweep.job_ids(manifest))])
        raise
    return proc.returncode, out, err


def status_of(job_id: str, runs_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflows.status", job_id, "--runs-dir", str(runs_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def check_never_started(manifest: dict, runs_dir: Path, out: str, expected: str) -> None:
    """Every training task is reported as ended before it started, with ``expected`` (its dependency)."""
    pre = manifest["preprocess"]
    for point in manifest["points"]:
        line = f"train {point['description']} job {point['train']}: CANCELLED before it started"
        assert f"{line}{expected.format(pre=pre)}" in out, out
    task = manifest["points"][1]["train"]
    status = status_of(task, runs_dir)
    assert status.returncode == 1, (status.stdout, status.stderr)
    assert f"train {manifest['points'][1]['description']} job {task}: CANCELLED before it started" in status.stdout
    assert status.stdout.rstrip().endswith("sweep: FAILED"), status.stdout


@pytest.mark.timeout(WAIT_TIMEOUT_S + 120)
def test_a_sweep_whose_preprocessing_fails_ends_failed_naming_the_dependency(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("this line is not JSON\n")
    runs_dir = tmp_path / "runs"
    budget = Budget(RETURN_WITHIN_S, "the sweep to end after its preprocessing failed")
    proc = start_sweep(runs_dir, corpus)
    manifest = manifest_of(runs_dir, proc)
    code, out, err = finish(proc, manifest, budget)
    assert code == 1, (out, err)
    assert "sweep failed" in err, err
    check_never_started(manifest, runs_dir, out,
                        ": its dependency afterok:{pre} can never be met (preprocess job {pre} ended FAILED)")


@pytest.mark.timeout(WAIT_TIMEOUT_S + 120)
def test_a_sweep_cancelled_while_its_array_is_pending_ends_failed(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    runs_dir = tmp_path / "runs"
    proc = start_sweep(runs_dir, corpus)
    manifest = manifest_of(runs_dir, proc)
    pre = manifest["preprocess"]
    # Hold the array first, so that it is still pending however fast the preprocessing runs.
    array = manifest["points"][0]["train"].partition("_")[0]
    slurm.run(["scontrol", "hold", array])
    slurm.run(["scancel", array, *[p["aggregate"] for p in manifest["points"]]])
    code, out, err = finish(proc, manifest)
    assert code == 1, (out, err)
    check_never_started(manifest, runs_dir, out, ", while waiting for afterok:{pre} (preprocess job {pre} ")
    records = sweep.query(manifest)
    assert sweep.state_of(records, pre) in slurm.TERMINAL_STATES  # the preprocessing itself ran on


@pytest.mark.timeout(WAIT_TIMEOUT_S + 120)
def test_a_task_cancelled_while_pending_ends_cancelled_while_the_other_completes(tmp_path):
    # Once task 0 has run, sacct keeps no line at all for a task 1 cancelled while pending.
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    runs_dir = tmp_path / "runs"
    proc = start_sweep(runs_dir, corpus)
    manifest = manifest_of(runs_dir, proc)
    first, second = (p["train"] for p in manifest["points"])
    array = first.partition("_")[0]
    slurm.run(["scontrol", "hold", array])
    slurm.run(["scancel", second])
    slurm.run(["scontrol", "release", array])
    code, out, err = finish(proc, manifest)
    assert code == 1, (out, err)
    assert f"train schedule=dpp job {second}: CANCELLED before it started, while waiting for afterok:" in out, out
    records = sweep.query(manifest)
    assert sweep.state_of(records, first) == "COMPLETED", out
    assert all(r.job_id != second for r in slurm.query(job_ids=[second, array]))  # sacct has no line for it
