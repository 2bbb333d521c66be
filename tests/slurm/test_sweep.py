"""`python -m workflows.submit --sweep` refuses a bad sweep before anything is queued.

A sweep that runs (one preprocessing job, the training runs as job arrays, one aggregation per run,
`workflows.status` showing the table from any of its ids) is tests/slurm/test_sweep_arrays.py's
``arrays`` sweep."""

from __future__ import annotations

import subprocess
import sys

from tests.slurm.test_chain import REPO


def run_module(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bad_sweeps_are_refused_in_one_line_before_anything_is_queued(tmp_path):
    done = run_module("workflows.submit", "gpt", "--nodes", "2", "--sweep", "pp=2,3", "--sweep", "schedule=zb",
                      "--sweep", "nosuch=1", "--runs-dir", str(tmp_path), timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for part in ("'zb' is not one of 1f1b, dpp", "--sweep nosuch: not a training setting",
                 "3 training ranks (PP=3 x TP=1) do not split evenly over --nodes 2"):
        assert part in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())
