"""Bad input to the submit/status command lines: one clear line, exit 2, nothing submitted or written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(module: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # A PATH without Slurm's commands: nothing can be submitted even when a cluster is up (the
    # slurm tier exports SLURM_CONF for the whole session), and bad input must fail before sbatch.
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    env = {**os.environ, "PATH": str(empty)}
    runs = ["--runs-dir", str(tmp_path / "runs")] if module.endswith("submit") else []
    return subprocess.run([sys.executable, "-m", module, *args, *runs],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("args", "message"), [
    (["llama"], "unknown recipe 'llama'; choose one of gpt, bert"),
    (["gpt", "--nodes", "0"], "--nodes 0: must be >= 1"),
    (["bert", "--nodes", "-3"], "--nodes -3: must be >= 1"),
    (["gpt", "--nodes", "two"], "argument --nodes: invalid int value: 'two'"),
    (["gpt", "--env", "INPUT=datasets/missing.jsonl.xz"], "missing data file(s): INPUT=datasets/missing.jsonl.xz"),
    (["gpt", "--env", "NUM_LAYER=3"], "unknown setting(s) NUM_LAYER"),
    (["gpt", "--env", "NUM_LAYERS"], "expected KEY=VALUE, got 'NUM_LAYERS'"),
    (["gpt", "--train-iters", "0"], "--train-iters 0: must be >= 1"),
    (["gpt", "--image", "./no-such-image.sqsh"], "--image ./no-such-image.sqsh: no such file"),
    (["gpt", "--image", "/nowhere/mdpp.sqsh"], "--image /nowhere/mdpp.sqsh: no such file"),
])
def test_submit_bad_input_is_one_line_and_status_2(tmp_path, args, message):
    result = run_cli("workflows.submit", *args, tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m workflows.submit: error: "), result.stderr
    assert message in lines[0]
    assert result.stdout == "" and not (tmp_path / "runs").exists()


def test_submit_without_slurm_says_how_to_get_it(tmp_path):
    result = run_cli("workflows.submit", "gpt", tmp_path=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "python -m workflows.submit: error: sbatch not found on PATH: run on a Slurm login node, or "
        "`source .cluster/env` after `scripts/cluster.sh up` for the local cluster"
    ]


@pytest.mark.parametrize("job_id", ["abc", "12;rm"])
def test_status_rejects_a_non_numeric_job_id(tmp_path, job_id):
    result = run_cli("workflows.status", job_id, tmp_path=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"python -m workflows.status: error: job id {job_id!r}: expected a number"
