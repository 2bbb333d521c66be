"""The sbatch files find their repository wherever they are started from, run its code, and leave
their outputs readable as the umask says; `workflows.submit` refuses bad knob values and an unusable
--runs-dir before anything is submitted.

The scripts run under bash with the recording `srun` of tests/unit/test_render_sbatch.py (the one
stand-in); tests/slurm/test_sbatch_standalone.py submits them from outside the repository for real.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_render_sbatch import REPO, TRAIN_ENV, run_sbatch
from workflows import jobs, preflight, submit


def without_repo_dir(tmp_path: Path, job: jobs.Job, script: Path, cwd: Path, **env: str):
    """Run ``script`` (``job``'s file or a copy) from ``cwd`` with no REPO_DIR in its environment."""
    _result, _argv = run_sbatch(job, tmp_path, **env)  # writes the fake srun/scontrol into tmp_path/bin
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in jobs.KNOB_NAMES and k not in ("REPO_DIR", "PYTHONPATH")}
    full_env = {**base, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAKE_SRUN_LOG": str(tmp_path / "srun.argv"),
                "OUTPUT_DIR": str(tmp_path / "out"), "DATA_PATH": str(tmp_path / "data"), **env}
    (tmp_path / "srun.argv").unlink(missing_ok=True)
    return subprocess.run(["bash", str(script)], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=60,
                          check=False)


def test_a_file_started_from_elsewhere_finds_its_repository_and_runs_its_code(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = without_repo_dir(tmp_path, jobs.TRAIN, REPO / "sbatch" / jobs.TRAIN.filename, elsewhere, **TRAIN_ENV)
    assert done.returncode == 0, done.stderr
    ranks_env = dict(line.split("=", 1) for line in (tmp_path / "srun.argv.env").read_text().splitlines()
                     if "=" in line)
    assert ranks_env["PYTHONPATH"].split(":")[0] == str(REPO)  # the ranks import this checkout's trainer
    assert ranks_env["PWD"] == str(REPO)


def test_a_copy_outside_the_repository_says_to_set_repo_dir(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    copy = elsewhere / jobs.PREPROCESS.filename
    shutil.copy(REPO / "sbatch" / jobs.PREPROCESS.filename, copy)
    done = without_repo_dir(tmp_path, jobs.PREPROCESS, copy, elsewhere)
    assert done.returncode == 2
    assert "cannot find the repository" in done.stderr and f"submit folder {elsewhere}" in done.stderr
    assert "set REPO_DIR=<the repository folder>" in done.stderr
    assert not (tmp_path / "srun.argv").exists()


def test_a_repo_dir_without_the_trainer_is_refused_naming_both_folders(tmp_path):
    not_repo = tmp_path / "not-a-checkout"
    not_repo.mkdir()
    result, argv = run_sbatch(jobs.PREPROCESS, tmp_path, REPO_DIR=str(not_repo), INPUT=str(REPO / "README.md"))
    assert (result.returncode, argv) == (2, []), result.stderr
    assert f"REPO_DIR={not_repo}: python3 would import trainer from " in result.stderr
    assert f"not from {not_repo}/trainer; set REPO_DIR to the repository folder" in result.stderr


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_outputs_written_private_get_the_read_bits_the_umask_grants(tmp_path, umask, mode):
    traces = tmp_path / "out" / "traces"
    traces.mkdir(parents=True)
    summary = traces / "summary.json"  # as the aggregation's atomic write leaves it: -rw-------
    summary.write_text("{}")
    summary.chmod(0o600)
    old = os.umask(umask)
    try:
        result, argv = run_sbatch(jobs.AGGREGATE, tmp_path)
    finally:
        os.umask(old)
    assert result.returncode == 0 and argv, result.stderr
    assert stat.S_IMODE(summary.stat().st_mode) == mode


def parse(tmp_path: Path, *argv: str):
    args = submit.build_parser().parse_args(["gpt", "--nodes", "2", "--runs-dir", str(tmp_path / "runs"), *argv])
    return submit.specs_from_args(args)


@pytest.fixture
def no_scontrol(monkeypatch):
    monkeypatch.setattr(preflight, "partition_problems", lambda nodes, partition: [])


def test_knob_values_are_checked_at_submission_naming_knob_and_value(tmp_path, no_scontrol):
    with pytest.raises(ValueError) as info:
        parse(tmp_path, "--env", "NUM_LAYERS=abc", "--env", "LR=fast", "--env", "BF16=2", "--env", "DEVICE=gpu",
              "--env", "SEED=0", "--env", "GPUS_PER_NODE=x")
    text = str(info.value)
    for part in ("NUM_LAYERS=abc: not an integer >= 1", "LR=fast: not a positive number", "BF16=2: must be 0 or 1",
                 "DEVICE=gpu: not one of cpu, cuda", "GPUS_PER_NODE=x: not an integer >= 0"):
        assert part in text, text
    assert "SEED" not in text  # 0 is a seed
    assert not (tmp_path / "runs").exists()


def test_submit_refuses_a_bad_knob_in_one_line_with_status_2(tmp_path, no_scontrol, capsys):
    with pytest.raises(SystemExit) as info:
        submit.main(["gpt", "--nodes", "2", "--env", "NUM_LAYERS=abc", "--runs-dir", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "NUM_LAYERS=abc: not an integer >= 1" in err, err


def test_a_runs_dir_that_cannot_be_written_is_one_clear_problem(tmp_path, no_scontrol):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(ValueError, match=rf"--runs-dir {a_file}/runs: {a_file} is a file, not a folder"):
        parse(tmp_path, "--runs-dir", str(a_file / "runs"))
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.access(read_only, os.W_OK):  # root writes anywhere: the check is the kernel's, not a mode's
        pytest.skip("this user can write to a mode 555 folder (root)")
    with pytest.raises(ValueError, match="is not writable by this user"):
        parse(tmp_path, "--runs-dir", str(read_only))
