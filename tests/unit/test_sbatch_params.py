"""sbatch parameters from the submit CLI: validation (every bad value in one message) and the options
each job gets, through plain sbatch and through submitit (no cluster needed: nothing is submitted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workflows import chain, jobs, recipes, submitit_chain
from workflows.sbatch_params import SbatchParams, as_flags

REPO = Path(__file__).resolve().parents[2]


def spec(tmp_path: Path, gpus: int = 0, **overrides: str) -> chain.ChainSpec:
    recipe = recipes.get("gpt", "gpu" if gpus else "cpu")
    return chain.ChainSpec(recipe=recipe, nodes=2 if not gpus else 1, repo_dir=REPO, run_dir=tmp_path / "run",
                           gpus_per_node=gpus, overrides=overrides)


def test_every_bad_value_is_named():
    params = SbatchParams(time="2 hours", account="a b", mem="lots", cpus_per_task=0, gpus_per_node=-1,
                          extra={"dependency": "afterok:1", "Bad_Key": "1", "qos": "x"})
    problems = params.problems()
    assert len(problems) == 8, problems
    for text in ("--time '2 hours'", "--account 'a b'", "--mem 'lots'", "--cpus-per-task 0",
                 "--gpus-per-node -1", "dependency: set by the driver", "'Bad_Key' is not", "qos: use --qos"):
        assert any(text in p for p in problems), (text, problems)


def test_good_values_pass_and_become_flags():
    params = SbatchParams(time="1-00:00:00", account="proj", qos="high", constraint="a100&ib", mem="0",
                          cpus_per_task=8, exclusive=True, extra={"mail-type": "END", "overcommit": ""})
    assert params.problems() == []
    assert as_flags(params.shared()) == ["--account=proj", "--qos=high", "--mail-type=END", "--overcommit"]
    assert as_flags(params.training())[-4:] == ["--time=1-00:00:00", "--constraint=a100&ib", "--mem=0", "--exclusive"]


def test_gpu_training_gets_gpus_whole_nodes_and_waits_for_all_nodes(tmp_path):
    train = chain.sbatch_options(spec(tmp_path, gpus=4), "train", tmp_path, after=None,
                                 params=SbatchParams(gpus_per_node=4))
    assert {"--gpus-per-node=4", "--exclusive", "--wait-all-nodes=1"} <= set(train)
    pre = chain.sbatch_options(spec(tmp_path, gpus=4), "preprocess", tmp_path, after=None,
                               params=SbatchParams(gpus_per_node=4))
    assert not any(o.startswith(("--gpus", "--exclusive", "--wait-all")) for o in pre)


def test_submitit_parameters_match_the_sbatch_files_contract(tmp_path):
    s, params = spec(tmp_path), SbatchParams(time="03:00:00", account="proj")
    train = submitit_chain.step_parameters(s, params, "train", tmp_path, after="afterok:5")
    extra = train["additional_parameters"]
    assert train["use_srun"] is False and train["nodes"] == 2 and train["ntasks_per_node"] == 1
    assert extra["dependency"] == "afterok:5" and extra["kill-on-invalid-dep"] == "yes"
    assert extra["requeue"] is True and extra["signal"] == "B:USR1@60" and extra["time"] == "03:00:00"
    assert extra["account"] == "proj" and extra["output"] == f"{tmp_path}/%x_%j.out"
    pre = submitit_chain.step_parameters(s, params, "preprocess", tmp_path, after=None)
    assert pre["additional_parameters"]["time"] == jobs.PREPROCESS.time_limit and "dependency" not in pre["additional_parameters"]


def test_last_traceback_is_the_final_block_up_to_the_exception_line():
    lines = ["start\n", "Traceback (most recent call last):\n", '  File "a.py", line 1\n', "KeyError: 1\n",
             "0: Traceback (most recent call last):\n", '0:   File "trainer/train.py", line 9, in main\n',
             "0:     parse()\n", "0: SystemExit: bad flag\n", "srun: error: node1: task 0: Exited\n"]
    assert submitit_chain.last_traceback(lines).splitlines() == [line.rstrip("\n") for line in lines[4:8]]
    assert submitit_chain.last_traceback(["no trace\n"]) is None


def test_aliases_and_transport_in_the_driver(tmp_path):
    env, problems = jobs.apply_aliases({"TENSOR_PARALLEL": "2", "PIPELINE_PARALLEL": "4", "PP": "2"})
    assert env["TP"] == "2" and problems == [
        "PIPELINE_PARALLEL=4 and PP=2 disagree (PIPELINE_PARALLEL is the AWS test case's name for PP): set one"]
    with pytest.raises(ValueError, match="TRANSPORT=rdma: not one of auto, shm, nccl, gloo"):
        spec(tmp_path, TRANSPORT="rdma")


def test_submit_names_every_bad_value_in_one_line_before_submitting(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "0", "--time", "soon", "--mem", "x",
         "--cpus-per-task", "0", "--sbatch-arg", "output=/tmp/x", "--env", "TENSOR_PARALLEL=2",
         "--env", "TP=1", "--env", "TRANSPORT=rdma", "--runs-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for text in ("--time 'soon'", "--mem 'x'", "--cpus-per-task 0", "output: set by the driver",
                 "TENSOR_PARALLEL=2 and TP=1 disagree", "--nodes 0", "TRANSPORT=rdma"):
        assert text in done.stderr, (text, done.stderr)
    assert not any(tmp_path.iterdir())  # nothing written, nothing submitted
