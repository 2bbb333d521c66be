"""The chain without Slurm: `python -m workflows.submit gpt --via local` runs the three steps on this
machine through submitit's LocalExecutor (the training as 2 real gloo ranks under torchrun), with the
Slurm chain's run folder, summary and `workflows.status` table; `--via debug` (submitit's
DebugExecutor, in the driver's process) stops a chain whose preprocessing fails the way Slurm's
--kill-on-invalid-dep does."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.test_chain import small_corpus
from workflows import local_chain

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a 2-iteration chain takes ~1-2 min on a loaded 2-core machine


def submit(runs_dir: Path, corpus: Path, via: str, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "workflows.submit", "gpt", "--via", via, "--train-iters", "2",
            "--env", f"INPUT={corpus}", "--runs-dir", str(runs_dir), "--timeout", str(TIMEOUT_S), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    old = os.umask(0o027)  # the group may read the run folder; others may not
    try:
        return subprocess.run(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT_S + 60, check=False)
    finally:
        os.umask(old)


def status_of(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflows.status", str(run_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.slow
def test_a_tiny_gpt_chain_runs_via_local_with_the_slurm_chains_folder_summary_and_status(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl", documents=60)
    done = submit(tmp_path / "runs", corpus, "local", "--env", f"EXTRA_TRAIN_ARGS=--metrics-dir {tmp_path / 'm'}")
    described = f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, described
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert {p.name for p in run_dir.iterdir()} >= {"logs", "data", "checkpoints", "traces", "submitit",
                                                   local_chain.MANIFEST}
    manifest = local_chain.read_manifest(run_dir)
    assert [(s["step"], s["state"]) for s in manifest["steps"]] == [
        ("preprocess", "COMPLETED"), ("train", "COMPLETED"), ("aggregate", "COMPLETED")]
    for step in manifest["steps"]:  # the Slurm chain's log names: <job name>_<job id>.out
        assert (run_dir / "logs" / f"{step['name']}_{step['job_id']}.out").is_file(), step
    assert list((run_dir / "data").rglob("*.bin")) and (run_dir / "checkpoints").iterdir()
    summary = json.loads((run_dir / "traces" / "summary.json").read_text())
    assert summary["schedule"] == "dpp" and len(summary["iterations"]) == 2, summary
    assert "summary: dpp PP=2" in done.stdout and done.stdout.rstrip().endswith("chain COMPLETED"), described
    # Both ranks ran, labelled, and recorded the run's real name (the chain passes --run-name).
    train_log = (run_dir / "logs" / f"{manifest['steps'][1]['name']}_{manifest['steps'][1]['job_id']}.out").read_text()
    assert f"--run-name {run_dir.name}" in train_log
    metrics = [json.loads(p.read_text()) for p in sorted((tmp_path / "m").glob("metrics_rank*.json"))]
    assert [m["run_name"] for m in metrics] == [run_dir.name] * 2
    # The traces were written -rw------- by their atomic writes: now readable by the group (umask 027).
    for path in (run_dir / "traces").glob("*.json"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o040, path
    status = status_of(run_dir)
    assert status.returncode == 0, status.stdout + status.stderr
    rows = [line.split()[:3] for line in status.stdout.splitlines()[1:4]]
    assert rows == [[s["job_id"], s["name"], "COMPLETED"] for s in manifest["steps"]], status.stdout
    assert status.stdout.rstrip().endswith("chain: COMPLETED (--via local, on this machine)")


def test_via_debug_a_failed_preprocessing_cancels_the_training_and_the_status_says_why(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("not JSON\n")
    done = submit(tmp_path / "runs", corpus, "debug")
    described = f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 1, described
    (run_dir,) = (tmp_path / "runs").iterdir()
    manifest = local_chain.read_manifest(run_dir)
    pre = manifest["steps"][0]
    assert [s["state"] for s in manifest["steps"]] == ["FAILED", "CANCELLED", "FAILED"], manifest
    assert pre["job_id"].startswith("DEBUG_")
    line = (f"train job -: CANCELLED before it started: its dependency afterok:{pre['job_id']} can never be met "
            f"(preprocess job {pre['job_id']} ended FAILED)")
    assert line in done.stdout, described
    assert "malformed JSON line" in done.stderr, described  # the failed step's own message
    status = status_of(run_dir)
    assert status.returncode == 1 and line in status.stdout, status.stdout
