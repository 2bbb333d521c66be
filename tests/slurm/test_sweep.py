"""`python -m workflows.submit --sweep` on the real local cluster: one
preprocessing job, the training runs as one job array, one aggregation per run, and
`workflows.status` showing the sweep as a table from any of its ids."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.corpus import small_corpus
from tests.slurm.test_chain import CHAIN_TIMEOUT_S, REPO


def run_module(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_a_two_run_sweep_preprocesses_once_trains_as_one_array_and_shows_a_table(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    runs_dir = tmp_path / "runs"
    done = run_module("workflows.submit", "gpt", "--nodes", "2", "--train-iters", "4",
                      "--sweep", "schedule=1f1b,dpp", "--env", f"INPUT={corpus}", "--runs-dir", str(runs_dir),
                      "--wait", "--timeout", str(CHAIN_TIMEOUT_S), timeout=CHAIN_TIMEOUT_S + 60)
    described = f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, described
    assert "sweep COMPLETED" in done.stdout, described

    (sweep_dir,) = runs_dir.iterdir()
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    points = manifest["points"]
    assert [p["description"] for p in points] == ["schedule=1f1b", "schedule=dpp"]
    # One array: the training jobs are tasks 0 and 1 of the same array id.
    array_ids = {p["train"].split("_")[0] for p in points}
    assert len(array_ids) == 1 and [p["train"].split("_")[1] for p in points] == ["0", "1"], points
    assert len({p["aggregate"] for p in points}) == 2
    # One dataset, written once, read by both runs; each run has its own folder and summary.
    assert list((sweep_dir / "data").rglob("*.bin"))
    for point, schedule in zip(points, ("1f1b", "dpp"), strict=True):
        run_dir = Path(point["run_dir"])
        assert run_dir.parent == sweep_dir and run_dir.name == f"schedule-{schedule}"
        summary = json.loads((run_dir / "traces" / "summary.json").read_text())
        assert summary["schedule"] == schedule and len(summary["iterations"]) == 4, summary
        assert not (run_dir / "data").exists()

    # The table, from a training task's id and from an aggregation's id.
    for job_id in (points[1]["train"], points[0]["aggregate"], manifest["preprocess"]):
        status = run_module("workflows.status", job_id, "--runs-dir", str(runs_dir), timeout=60)
        assert status.returncode == 0, (job_id, status.stdout, status.stderr)
        lines = status.stdout.splitlines()
        assert lines[1].split() == ["configuration", "train", "state", "aggregate", "ms/iter", "bubble"]
        for line, point in zip(lines[2:4], points, strict=True):
            assert re.match(rf"{point['description']}\s+{point['train']}\s+COMPLETED\s+COMPLETED\s+"
                            r"\d+\.\d\s+0\.\d{4}$", line), status.stdout
        assert lines[-1] == "sweep: COMPLETED"
    # Without the runs folder it cannot find the manifest, and says what to pass.
    lost = run_module("workflows.status", points[0]["aggregate"], "--runs-dir", str(tmp_path), timeout=60)
    assert lost.returncode == 2 and "--runs-dir" in lost.stderr, lost.stderr


def test_bad_sweeps_are_refused_in_one_line_before_anything_is_queued(tmp_path):
    done = run_module("workflows.submit", "gpt", "--nodes", "2", "--sweep", "pp=2,3", "--sweep", "schedule=zb",
                      "--sweep", "nosuch=1", "--runs-dir", str(tmp_path), timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for part in ("'zb' is not one of 1f1b, dpp", "--sweep nosuch: not a training setting",
                 "3 training ranks (PP=3 x TP=1) do not split evenly over --nodes 2"):
        assert part in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())
