"""--sweep parsing and validation, the runs it makes and the status table; no
cluster needed: nothing is submitted, sacct's answers are canned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workflows import preflight, slurm, status, submit, sweep


def runs_of(tmp_path: Path, *argv: str):
    args = submit.build_parser().parse_args(["gpt", "--nodes", "2", "--runs-dir", str(tmp_path), *argv])
    return submit.specs_from_args(args)


@pytest.fixture(autouse=True)
def no_scontrol(monkeypatch):
    monkeypatch.setattr(preflight, "partition_problems", lambda nodes, partition: [])


def test_axes_are_parsed_with_short_names_aliases_and_schedules():
    axes, problems = sweep.parse(["pp=2,4", "schedule=1f1b,dpp", "MICRO_BATCH_SIZE=1", "PIPELINE_PARALLEL=2"])
    assert problems == ["--sweep PIPELINE_PARALLEL: PP is already swept by --sweep pp"]
    assert [(a.key, a.knob, a.values) for a in axes] == [
        ("pp", "PP", ("2", "4")), ("schedule", "USE_DPP", ("1f1b", "dpp")), ("MICRO_BATCH_SIZE", "MICRO_BATCH_SIZE", ("1",))]
    points = sweep.points(axes)
    assert [p.label for p in points] == ["pp-2_schedule-1f1b_micro_batch_size-1",
                                         "pp-2_schedule-dpp_micro_batch_size-1",
                                         "pp-4_schedule-1f1b_micro_batch_size-1",
                                         "pp-4_schedule-dpp_micro_batch_size-1"]
    assert points[1].overrides == {"PP": "2", "USE_DPP": "1", "MICRO_BATCH_SIZE": "1"}
    assert points[2].description == "pp=4 schedule=1f1b MICRO_BATCH_SIZE=1"


def test_every_bad_axis_is_named():
    _axes, problems = sweep.parse(["pp", "pp=", "tp=0,x", "schedule=zb", "bf16=2", "data_path=/x", "nosuch=1",
                                   "layers=2,2", "lr=a/b", "seed=1,", "train_iters=3"], fixed={"TRAIN_ITERS": "4"})
    text = "; ".join(problems)
    for part in ("--sweep 'pp': expected KEY=VALUE", "--sweep 'pp=': expected", "--sweep tp: TP=0: not an integer >= 1",
                 "--sweep tp: TP=x: not an integer >= 1", "--sweep schedule: 'zb' is not one of 1f1b, dpp",
                 "--sweep bf16: BF16=2: must be 0 or 1", "--sweep data_path: not a training setting",
                 "--sweep nosuch: not a training setting", "--sweep layers: value(s) given twice: 2",
                 "--sweep lr: value 'a/b' must be", "--sweep seed: empty value",
                 "--sweep train_iters: TRAIN_ITERS is also set to 4"):
        assert part in text, (part, text)


def test_too_many_runs_are_refused():
    _axes, problems = sweep.parse(["seed=" + ",".join(map(str, range(1, 9))), "layers=" + ",".join(map(str, range(1, 10)))])
    assert problems == [f"--sweep: 72 runs, more than {sweep.MAX_POINTS}; split the sweep"]


def test_each_run_has_its_folder_and_shares_the_sweeps_dataset(tmp_path):
    base, _params, runs = runs_of(tmp_path, "--sweep", "schedule=1f1b,dpp", "--train-iters", "4")
    assert [spec.run_dir for _p, spec in runs] == [base.run_dir / "schedule-1f1b", base.run_dir / "schedule-dpp"]
    for (_point, spec), use_dpp in zip(runs, ("0", "1"), strict=True):
        env = spec.environment()
        assert env["DATA_PATH"] == str(base.run_dir / "data") == base.environment()["DATA_PATH"]
        assert env["OUTPUT_DIR"] == str(spec.run_dir) and env["USE_DPP"] == use_dpp and env["TRAIN_ITERS"] == "4"
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # validation writes nothing


def test_layout_problems_of_any_run_are_named_with_the_bad_values_in_one_message(tmp_path):
    with pytest.raises(ValueError) as info:
        runs_of(tmp_path, "--sweep", "pp=2,3", "--sweep", "schedule=1f1b,zb", "--via", "submitit")
    text = str(info.value)
    assert "--sweep schedule: 'zb' is not one of 1f1b, dpp" in text
    assert "--sweep run(s) pp=3 schedule=1f1b, pp=3 schedule=zb: 3 training ranks (PP=3 x TP=1) do not split " \
           "evenly over --nodes 2" in text
    with pytest.raises(ValueError, match="--sweep needs --via submitit"):
        runs_of(tmp_path, "--sweep", "pp=2", "--via", "sbatch")


def test_no_sweep_is_the_plain_chain(tmp_path):
    _spec, _params, runs = runs_of(tmp_path)
    assert runs == []


def test_job_names_lead_back_to_the_sweep_and_are_never_a_chains():
    from workflows import chain
    name = sweep.job_name(Path("/r/gpt-20260101-000000-abcd"), "train")
    assert sweep.sweep_of(name) == "gpt-20260101-000000-abcd"
    assert chain.chain_names(name) is None
    assert sweep.sweep_of("mdpp-gpt-x-train") is None


def test_status_shows_the_sweep_table_from_an_array_task_id(tmp_path, monkeypatch, capsys):
    sweep_dir = tmp_path / "gpt-20260101-000000-abcd"
    (sweep_dir / "schedule-1f1b" / "traces").mkdir(parents=True)
    (sweep_dir / "schedule-1f1b" / "traces" / "summary.json").write_text(
        json.dumps({"mean_iteration_time_ms": 812.345, "bubble_fraction": 0.31}))
    points = [{"description": f"schedule={s}", "run_dir": str(sweep_dir / f"schedule-{s}"),
               "train": f"11_{i}", "aggregate": str(12 + i)} for i, s in enumerate(("1f1b", "dpp"))]
    sweep.write_manifest(sweep_dir, {"name": sweep_dir.name, "recipe": "gpt/cpu", "preprocess": "10",
                                     "points": points, "logs": str(sweep_dir / "logs")})
    stem = sweep.job_name(sweep_dir, "")
    rows = {"10": f"10|{stem}preprocess|COMPLETED|0:0|00:00:05|node1|x|y",
            "11_0": f"11_0|{stem}train|COMPLETED|0:0|00:01:00|node[1-2]|x|y",
            "11_1": f"11_1|{stem}train|RUNNING|0:0|00:00:30|node[1-2]|x|None",
            "12": f"12|{stem}aggregate|COMPLETED|0:0|00:00:02|node1|x|y",
            "13": f"13|{stem}aggregate|PENDING|0:0|00:00:00|None assigned|None|None"}

    def fake(args, **_kw):
        args = list(args)
        wanted = args[args.index("-j") + 1].split(",")
        if wanted == ["14"]:  # task 1's own id: sacct answers with the array form
            return rows["11_1"]
        return "\n".join(rows[w] for w in wanted if w in rows)

    monkeypatch.setattr(slurm, "run", fake)
    assert status.main(["14", "--runs-dir", str(tmp_path)]) == status.EXIT_RUNNING
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"sweep {sweep_dir.name}: gpt/cpu, preprocess job 10 COMPLETED"
    assert out[2].split() == ["schedule=1f1b", "11_0", "COMPLETED", "COMPLETED", "812.3", "0.3100"]
    assert out[3].split() == ["schedule=dpp", "11_1", "RUNNING", "PENDING", "-", "-"]
    assert out[-1] == "sweep: RUNNING"
    with pytest.raises(SystemExit) as info:
        status.main(["12", "--runs-dir", str(tmp_path / "elsewhere")])
    assert info.value.code == 2
    assert "pass the submit's --runs-dir" in capsys.readouterr().err


def test_status_reports_a_failed_array_task_with_its_log_tail_and_remote_traceback(tmp_path, monkeypatch, capsys):
    import submitit

    from workflows import submitit_chain
    sweep_dir = tmp_path / "gpt-20260101-000000-abcd"
    points = [{"description": f"heads={h}", "run_dir": str(sweep_dir / f"heads-{h}"), "train": f"11_{i}",
               "aggregate": str(12 + i)} for i, h in enumerate((4, 3))]
    manifest = {"name": sweep_dir.name, "recipe": "gpt/cpu", "preprocess": "10", "points": points,
                "logs": str(sweep_dir / "logs")}  # no "submitit" key: an older manifest
    sweep_dir.mkdir()
    sweep.write_manifest(sweep_dir, manifest)
    log = sweep.log_path(manifest, "train", "11_1")
    assert log.name == f"mdppsweep-{sweep_dir.name}-train_11_1.out"  # %x_%A_%a
    log.parent.mkdir(parents=True)
    log.write_text("train: gpt/cpu on 2 node(s), 2 ranks\n0: error: --num-attention-heads=3 is bad\n"
                   "submitit ERROR (x) - Submitted job triggered an exception\n"
                   "Traceback (most recent call last):\n  File x\nStepFailed: copy in the log\n")
    pickle = submitit_chain.result_pickle(sweep.submitit_folder(manifest), "11_1")
    assert pickle == sweep_dir / "submitit" / "11_1_0_result.pkl"
    pickle.parent.mkdir()
    submitit.core.utils.cloudpickle_dump(("error", "Traceback (most recent call last):\n"
                                          "StepFailed: train: `bash t` exited 2"), pickle)
    stem = sweep.job_name(sweep_dir, "")
    rows = [f"10|{stem}preprocess|COMPLETED|0:0|00:00:05|node1|x|y",
            f"11_0|{stem}train|COMPLETED|0:0|00:01:00|node[1-2]|x|y",
            f"11_1|{stem}train|FAILED|2:0|00:00:09|node[1-2]|x|y",
            f"12|{stem}aggregate|COMPLETED|0:0|00:00:02|node1|x|y",
            f"13|{stem}aggregate|COMPLETED|0:0|00:00:02|node1|x|y"]
    monkeypatch.setattr(slurm, "run", lambda args, **_kw: "\n".join(rows))
    assert status.main(["10", "--runs-dir", str(tmp_path)]) == status.EXIT_FAILED
    out = capsys.readouterr().out
    assert "train heads=3 job 11_1: FAILED, exit code 2:0" in out
    assert "    0: error: --num-attention-heads=3 is bad" in out and "copy in the log" not in out
    assert "  remote traceback (submitit):\n    Traceback (most recent call last):\n" \
           "    StepFailed: train: `bash t` exited 2" in out
    assert "job 11_0:" not in out and "aggregate heads" not in out
    assert out.rstrip().endswith("sweep: FAILED")


def test_array_tasks_that_never_started_take_the_state_of_saccts_one_line():
    # A pending array, and one cancelled by a failed dependency, are one sacct line each: 21_[0-1%2].
    records = sweep.records_by_id(slurm.parse_sacct(
        "20|p|FAILED|1:0|00:00:01|node1|x|y\n"
        "21_[0-1%2]|t|CANCELLED|0:0|00:00:00|None assigned|None|y\n"
        "22_[0,2-3]|t|PENDING|0:0|00:00:00|None assigned|None|None\n"
        "23|a|COMPLETED|0:0|00:00:01|node1|x|y\n"))
    assert [sweep.state_of(records, i) for i in ("21_0", "21_1", "21_2", "22_2", "22_1", "24")] == \
        ["CANCELLED", "CANCELLED", "UNKNOWN", "PENDING", "UNKNOWN", "UNKNOWN"]
    assert sweep.record_of(records, "21_1").job_id == "21_1"
    manifest = {"preprocess": "20", "points": [{"description": "pp=2", "train": "21_0", "aggregate": "23"},
                                               {"description": "pp=4", "train": "21_1", "aggregate": "23"}]}
    assert sweep.verdict(manifest, records) == "FAILED"  # not RUNNING for ever


def test_a_job_names_itself_to_scontrol_as_its_array_task(monkeypatch):
    # The array's last task has the array's own id as SLURM_JOB_ID; scontrol takes that id for
    # every task of the array (requeueing one task requeued them all).
    from workflows import submitit_chain
    monkeypatch.setenv("SLURM_JOB_ID", "141")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    assert submitit_chain.own_job_id() == "141"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "141")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert submitit_chain.own_job_id() == "141_2"
    from workflows.render import SBATCH_DIR
    text = (SBATCH_DIR / "2.distributed-training.sbatch").read_text()
    assert 'SELF=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}' in text
    assert 'scontrol requeue "$SELF"' in text and 'scontrol requeue "$SLURM_JOB_ID"' not in text


def test_an_array_that_never_ran_is_queried_by_its_own_id_and_named_with_its_dependency(tmp_path, monkeypatch,
                                                                                        capsys):
    # Slurm 22.05: `sacct -j 31_1` prints nothing for a task of an array that never ran; `sacct -j 31`
    # prints the array's one line. The status of a task id must find that line (not "not found").
    assert sweep.query_ids(["30", "31_0", "31_1", "32"]) == ["30", "31_0", "31_1", "32", "31"]
    sweep_dir = tmp_path / "gpt-20260101-000000-abcd"
    sweep_dir.mkdir()
    points = [{"description": f"pp={p}", "run_dir": str(sweep_dir / f"pp-{p}"), "train": f"31_{i}",
               "aggregate": str(32 + i)} for i, p in enumerate((2, 4))]
    manifest = {"name": sweep_dir.name, "recipe": "gpt/cpu", "preprocess": "30", "points": points,
                "logs": str(sweep_dir / "logs"), "submitit": str(sweep_dir / "submitit")}
    sweep.write_manifest(sweep_dir, manifest)
    stem = sweep.job_name(sweep_dir, "")
    rows = {"30": f"30|{stem}preprocess|FAILED|1:0|00:00:05|node1|x|y",
            "31": f"31_[0-1]|{stem}train|CANCELLED|0:0|00:00:00|None assigned|x|x",
            "32": f"32|{stem}aggregate|CANCELLED by 0|0:0|00:00:00|None assigned|None|x",
            "33": f"33|{stem}aggregate|FAILED|1:0|00:00:01|node1|x|y"}
    asked = []

    def sacct(args, **_kw):
        wanted = args[args.index("-j") + 1].split(",")
        asked.append(wanted)
        return "\n".join(rows[i] for i in wanted if i in rows)

    monkeypatch.setattr(slurm, "run", sacct)
    assert status.main(["31_1", "--runs-dir", str(tmp_path)]) == status.EXIT_FAILED
    out = capsys.readouterr().out
    assert asked[0] == ["31_1", "31"]
    assert "train pp=4 job 31_1: CANCELLED before it started: its dependency afterok:30 can never be met " \
           "(preprocess job 30 ended FAILED)" in out
    assert "aggregate pp=2 job 32: CANCELLED before it started, while waiting for afterany:31_0 " \
           "(train pp=2 job 31_0 CANCELLED)" in out
    assert "aggregate pp=4 job 33: FAILED" in out and "job 33: FAILED before" not in out  # it ran
    assert out.rstrip().endswith("sweep: FAILED")


def test_a_chain_names_the_dependency_of_a_step_that_never_ran():
    records = slurm.parse_sacct("40|a-preprocess|FAILED|1:0|00:00:01|node1|x|y\n"
                                "41|a-train|CANCELLED by 0|0:0|00:00:00|None assigned|None|y\n"
                                "42|a-aggregate|COMPLETED|0:0|00:00:01|node1|x|y\n")
    from workflows import chain
    assert chain.never_started(records) == [
        "train job 41: CANCELLED before it started: its dependency afterok:40 can never be met "
        "(preprocess job 40 ended FAILED)"]


@pytest.mark.parametrize(("held", "vanished"), [("0", True), ("0-1", False), (None, True)])
def test_a_task_cancelled_while_its_array_ran_on_is_cancelled_not_unknown(monkeypatch, held, vanished):
    # Once task 0 ran, sacct keeps no line for a task 1 cancelled while pending; slurmctld has
    # forgotten it too (`scontrol show job 51` lists the tasks it still holds).
    import subprocess
    manifest = {"preprocess": "50", "points": [{"description": f"pp={p}", "train": f"51_{i}", "aggregate": str(53 + i)}
                                               for i, p in enumerate((2, 4))]}
    rows = ["50|s-preprocess|COMPLETED|0:0|00:00:01|node1|x|y", "51_0|s-train|RUNNING|0:0|00:00:09|node1|x|y",
            "53|s-aggregate|PENDING|0:0|00:00:00|None assigned|x|y", "54|s-aggregate|PENDING|0:0|00:00:00|None assigned|x|y"]
    monkeypatch.setattr(slurm, "run", lambda args, **_kw: "\n".join(rows))
    answer = (subprocess.CompletedProcess([], 0, f"JobId=52 ArrayJobId=51 ArrayTaskId={held} JobState=RUNNING\n", "")
              if held else subprocess.CompletedProcess([], 1, "", "slurm_load_jobs error: Invalid job id specified"))
    monkeypatch.setattr(slurm, "call", lambda args, *a, **kw: answer)
    records = sweep.query(manifest)
    assert sweep.state_of(records, "51_0") == "RUNNING"
    assert sweep.state_of(records, "51_1") == ("CANCELLED" if vanished else "UNKNOWN")
    if vanished:
        assert records["51_1"].never_ran
        assert sweep.never_started(manifest, records) == [
            "train pp=4 job 51_1: CANCELLED before it started, while waiting for afterok:50 (preprocess job 50 COMPLETED)"]
