"""The rendered sbatch files: golden copies, enforced quoting, and what they run under bash.

The scripts run for real under bash here; only `srun` is replaced, by a script that records its
argv (Pyxis does not exist on this machine, so the container flags can only be checked on the srun
line: this is the one stand-in, and the Slurm tests run the same files on the real local cluster).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jinja2
import pytest

from workflows import jobs, recipes, render, shell

REPO = Path(__file__).resolve().parents[2]
FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_SRUN_LOG"
env > "$FAKE_SRUN_LOG.env"  # what the ranks would inherit
# Plays the ranks: by default they finish ("done"); FAKE_RANKS=... picks another ending.
record() { if [[ -n "${MDPP_EXIT_RECORD:-}" ]]; then echo "$1" > "$MDPP_EXIT_RECORD"; fi; }
case "${FAKE_RANKS:-done}" in
    done) record "done 20" ;;
    done-then-term) record "done 20"; exit 143 ;;  # a rank's tear-down cut by TERM (a late preemption)
    done-then-crash) record "done 20"; exit 1 ;;  # a rank's tear-down failed
    crash) exit 1 ;;
    stopped) record "stopped 9"; exit 75 ;;
    killed-peer) record "checkpointed 9"; exit 143 ;;  # --kill-on-bad-exit's SIGTERM to the peer
    exit0-no-record) exit 0 ;;
    wait-signal|slow-start)  # run until USR1 comes, then checkpoint as the ranks do
        echo started > "$FAKE_SRUN_LOG.started"
        # slow-start: ranks still starting Python, where USR1's default action would kill them
        if [[ $FAKE_RANKS == slow-start ]]; then sleep 2; fi
        trap 'echo USR1 >> "$FAKE_SRUN_LOG.signals"; record "checkpointed 4"; exit 75' USR1
        ntasks=$(printf '%s\n' "$@" | sed -n 's/^--ntasks=//p')
        for ((i = 0; i < ${ntasks:-1}; i++)); do : > "$MDPP_READY_DIR/rank$i"; done  # as trainer.launch.early_signals
        for _ in $(seq 200); do sleep 0.1; done
        exit 9 ;;
    killed-on-signal)  # srun got TERM too and SIGKILLed the ranks: no checkpoint, no record
        echo started > "$FAKE_SRUN_LOG.started"
        trap 'echo USR1 >> "$FAKE_SRUN_LOG.signals"; exit 137' USR1
        ntasks=$(printf '%s\n' "$@" | sed -n 's/^--ntasks=//p')
        for ((i = 0; i < ${ntasks:-1}; i++)); do : > "$MDPP_READY_DIR/rank$i"; done
        for _ in $(seq 200); do sleep 0.1; done
        exit 9 ;;
    killed-on-signal-peer-noticed)  # the same, but rank 0 noticed its killed peer first and recorded it
        echo started > "$FAKE_SRUN_LOG.started"
        trap 'echo USR1 >> "$FAKE_SRUN_LOG.signals"
              record "failed at iteration 5: rank 0 on node1 (rank 1 lost): TransportError: peer rank 1 is probably dead"
              exit 137' USR1
        ntasks=$(printf '%s\n' "$@" | sed -n 's/^--ntasks=//p')
        for ((i = 0; i < ${ntasks:-1}; i++)); do : > "$MDPP_READY_DIR/rank$i"; done
        for _ in $(seq 200); do sleep 0.1; done
        exit 9 ;;
esac
"""
# Answers `show job` with FAKE_JOB_STATE (RUNNING unless a test says Slurm is ending the job) and
# records every other command.
FAKE_SCONTROL = """#!/bin/bash
if [[ "$1" == show ]]; then echo "JobId=7 JobName=mdpp-train JobState=${FAKE_JOB_STATE:-RUNNING} Reason=None"; exit 0; fi
echo "$@" >> "$FAKE_SRUN_LOG.scontrol"
"""


def run_sbatch(job: jobs.Job, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run sbatch/<job> under bash with a recording srun; (result, srun argv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    log = tmp_path / "srun.argv"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in jobs.KNOB_NAMES}
    full_env = {
        **base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SRUN_LOG": str(log),
        "REPO_DIR": str(REPO), "OUTPUT_DIR": str(tmp_path / "out"), "DATA_PATH": str(tmp_path / "data"),
        **env,
    }
    result = subprocess.run(["bash", str(REPO / "sbatch" / job.filename)], env=full_env,
                            capture_output=True, text=True, timeout=30, check=False)
    argv = log.read_bytes().decode().split("\0")[:-1] if log.exists() else []
    return result, argv


def expected_command(job: jobs.Job, recipe: recipes.Recipe, env: dict[str, str]) -> list[str]:
    values = jobs.resolve(job, recipe, env)
    return [values["PYTHON"], "-m", job.module, *jobs.knob_arguments(job, values)]


def test_committed_sbatch_files_are_byte_identical_to_the_render():
    assert render.drift(render.render_all(), REPO / "sbatch") == [], render.HINT


def test_check_prints_a_diff_and_the_hint_when_a_file_drifts(tmp_path, capsys):
    render.write(render.render_all(), tmp_path)
    target = tmp_path / jobs.TRAIN.filename
    target.write_text(target.read_text().replace("NUM_LAYERS:-4", "NUM_LAYERS:-5"))
    assert render.main(["--check", "--output-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "-        NUM_LAYERS=${NUM_LAYERS:-5}" in captured.out
    assert "+        NUM_LAYERS=${NUM_LAYERS:-4}" in captured.out
    assert render.HINT in captured.err
    render.write(render.render_all(), tmp_path)
    assert render.main(["--check", "--output-dir", str(tmp_path)]) == 0


def test_an_interpolation_without_a_quoting_filter_fails_the_render():
    env = render.environment()
    with pytest.raises(TypeError, match="without the q/name/assign/comment filter"):
        env.from_string("X={{ value }}").render(value="a b")
    assert env.from_string("X={{ value | q }}").render(value="a b") == "X='a b'"
    with pytest.raises(jinja2.UndefinedError):  # StrictUndefined: a typo is an error, not ''
        env.from_string("{{ missing | q }}").render()


@pytest.mark.parametrize("hostile", ["$(touch PWNED)", "a'b\"c", "x; touch PWNED", "`touch PWNED`", "*", ""])
def test_assign_keeps_hostile_defaults_literal(tmp_path, hostile):
    line = render.environment().from_string("{{ 'V' | assign(value) }}").render(value=hostile)
    script = f'{line}\nprintf "%s" "$V"\n'
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout == hostile
    assert not (tmp_path / "PWNED").exists()


def test_names_and_comments_are_validated_not_quoted():
    with pytest.raises(ValueError, match="variable name"):
        shell.name("A; rm")
    with pytest.raises(ValueError, match="one line"):
        render.environment().from_string("# {{ t | comment }}").render(t="a\nrm -rf /")


@pytest.mark.parametrize("recipe", recipes.all_recipes(), ids=lambda r: r.key)
@pytest.mark.parametrize("job", [jobs.PREPROCESS, jobs.AGGREGATE], ids=lambda j: j.key)
def test_sbatch_runs_exactly_the_recipe_command(tmp_path, recipe, job):
    env = {"MODEL": recipe.model, "SIZE": recipe.size}
    result, argv = run_sbatch(job, tmp_path, **env)
    assert result.returncode == 0, result.stderr
    full_env = {"REPO_DIR": str(REPO), "OUTPUT_DIR": str(tmp_path / "out"), "DATA_PATH": str(tmp_path / "data")}
    command = expected_command(job, recipe, full_env)
    assert argv[-len(command):] == command
    assert argv[:3] == ["--nodes=1", "--ntasks=1", command[0]]  # host environment: no Pyxis flags


@pytest.mark.parametrize("recipe", recipes.all_recipes(), ids=lambda r: r.key)
def test_training_sbatch_runs_the_recipe_command_with_node_addresses(tmp_path, recipe):
    env = {"MODEL": recipe.model, "SIZE": recipe.size, "NODE_IPS": "10.0.0.1,10.0.0.2",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "7"}
    if recipe.gpus_per_node:
        env["SLURM_GPUS_ON_NODE"] = str(recipe.gpus_per_node)  # what Slurm sets for --gpus-per-node
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, **env)
    assert result.returncode == 0, result.stderr
    command = expected_command(jobs.TRAIN, recipe, {"REPO_DIR": str(REPO), "OUTPUT_DIR": str(tmp_path / "out"),
                                                    "DATA_PATH": str(tmp_path / "data")})
    runtime = ["--node-ips", "10.0.0.1,10.0.0.2", "--multi-node"]
    assert argv[-len(command) - len(runtime):] == command + runtime
    ranks = 2 * recipe.gpus_per_node if recipe.gpus_per_node else recipe.parallel.pipeline * recipe.parallel.tensor
    assert argv[:4] == ["--nodes=2", f"--ntasks={ranks}", f"--ntasks-per-node={ranks // 2}", "--kill-on-bad-exit=1"]
    assert "MASTER_ADDR=10.0.0.1" in result.stdout
    assert (tmp_path / "out" / "checkpoints").is_dir() and (tmp_path / "out" / "traces").is_dir()


def test_environment_overrides_replace_recipe_defaults(tmp_path):
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, NODE_IPS="10.0.0.1", NUM_LAYERS="8", PP="1",
                              TRAIN_ITERS="3", USE_DPP="0", EXTRA_TRAIN_ARGS="--foo 1 --bar")
    assert result.returncode == 0, result.stderr
    assert argv[argv.index("--num-layers") + 1] == "8"
    assert argv[argv.index("--pipeline-model-parallel-size") + 1] == "1"
    assert argv[argv.index("--train-iters") + 1] == "3"
    assert "--use-dpp" not in argv and "--multi-node" not in argv
    assert argv[-3:] == ["--foo", "1", "--bar"]
    assert "--ntasks=1" in argv  # PP*TP ranks on CPU


def test_image_adds_pyxis_flags_to_srun(tmp_path):
    result, argv = run_sbatch(jobs.PREPROCESS, tmp_path, IMAGE="/images/mdpp.sqsh")
    assert result.returncode == 0, result.stderr
    data, out = tmp_path / "data", tmp_path / "out"
    assert argv[2:5] == [
        "--container-image=/images/mdpp.sqsh",
        f"--container-mounts={data}:{data},{out}:{out}",
        f"--container-workdir={jobs.CONTAINER_WORKDIR}",
    ]
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, IMAGE="reg#mdpp:latest", NODE_IPS="10.0.0.1",
                              CONTAINER_MOUNTS="/fsx:/fsx")
    assert "--container-mounts=/fsx:/fsx" in argv and "--container-image=reg#mdpp:latest" in argv
    assert argv.index("--container-image=reg#mdpp:latest") < argv.index("python3")


@pytest.mark.parametrize("job", jobs.JOBS, ids=lambda j: j.key)
def test_unknown_recipe_is_one_clear_line_and_status_2(tmp_path, job):
    result, argv = run_sbatch(job, tmp_path, MODEL="llama", NODE_IPS="10.0.0.1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: MODEL=llama SIZE=cpu: no such recipe; MODEL/SIZE is one of gpt/cpu gpt/gpu bert/cpu bert/gpu"
    ]
    assert argv == []


def test_preprocessing_refuses_a_missing_corpus(tmp_path):
    result, argv = run_sbatch(jobs.PREPROCESS, tmp_path, INPUT="datasets/nope.jsonl")
    assert (result.returncode, result.stderr.strip(), argv) == (2, "error: INPUT=datasets/nope.jsonl: no such file", [])


# ---- how the training job ends: never COMPLETED unless every iteration ran -----------------------
TRAIN_ENV = {"NODE_IPS": "10.0.0.1,10.0.0.2", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "7"}


@pytest.mark.parametrize(("ranks", "status", "requeued"), [
    ("done", 0, False),
    ("crash", 1, False),
    ("stopped", 75, False),          # stopped on a signal without --save: nothing to resume
    ("killed-peer", 0, True),        # checkpointed; srun says 143 because a peer was cut: requeue
    ("exit0-no-record", 1, False),   # ranks exited 0 but never said they finished
    # Every iteration and the final save ran; a TERM to the ranks only (a preemption in the job's
    # last second, seen in a CI run: the job ended FAILED after "done 12") cut one rank's tear-down.
    ("done-then-term", 0, False),
    ("done-then-crash", 1, False),   # an error of its own in the tear-down stays a failure
])
def test_training_job_status_follows_the_exit_record(tmp_path, ranks, status, requeued):
    result, _argv = run_sbatch(jobs.TRAIN, tmp_path, FAKE_RANKS=ranks, **TRAIN_ENV)
    assert result.returncode == status, result.stdout + result.stderr
    scontrol = tmp_path / "srun.argv.scontrol"
    assert (scontrol.read_text() == "requeue 7\n") if requeued else not scontrol.exists()
    assert not list((tmp_path / "out").glob(".train-exit-*"))  # the record is removed


def test_a_job_that_slurm_is_ending_keeps_slurms_decision(tmp_path):
    """Before: ranks that saved on the TERM of a plain `scancel` made the script `scontrol requeue`
    its job, which Slurm accepts for a cancelled job too: the cancelled job came back (seen on the
    local cluster once KillWait gave the ranks time to save). A job that is no longer RUNNING
    (COMPLETING: scancel, scontrol requeue, preemption, the time limit) is never requeued by the script."""
    result, _argv = run_sbatch(jobs.TRAIN, tmp_path, FAKE_RANKS="killed-peer", FAKE_JOB_STATE="COMPLETING",
                               **TRAIN_ENV)
    assert result.returncode == 75, result.stdout + result.stderr
    assert "Slurm is ending job 7 itself (JobState=COMPLETING" in result.stderr
    assert not (tmp_path / "srun.argv.scontrol").exists()


def signal_the_batch_shell(tmp_path: Path, signame: str, **env: str) -> subprocess.CompletedProcess:
    """Run the training file under bash with the fake srun, send `signame` to the shell once srun
    has started; the finished process."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    run_sbatch(jobs.TRAIN, tmp_path, FAKE_RANKS="done", **TRAIN_ENV)  # writes the fakes
    (tmp_path / "srun.argv.scontrol").unlink(missing_ok=True)
    full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in jobs.KNOB_NAMES},
                "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SRUN_LOG": str(tmp_path / "srun.argv"),
                "REPO_DIR": str(REPO), "OUTPUT_DIR": str(tmp_path / "out"), "DATA_PATH": str(tmp_path / "data"),
                **TRAIN_ENV, **env}
    proc = subprocess.Popen(["bash", str(REPO / "sbatch" / jobs.TRAIN.filename)], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (tmp_path / "srun.argv.started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(getattr(signal, f"SIG{signame}"))
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize(("signame", "ranks"), [("USR1", "wait-signal"), ("TERM", "wait-signal"),
                                               ("USR1", "slow-start")])
def test_a_signal_to_the_batch_shell_reaches_the_ranks_as_usr1_and_requeues(tmp_path, signame, ranks):
    """Before: TERM to the shell was only logged and the job ran on to COMPLETED (or ended early as 0).
    slow-start: the signal comes while the ranks are still starting (no handler yet); forwarded then,
    USR1 would kill them (seen in a loaded CI run: srun exit 138, job FAILED) -- the script holds it
    until every rank has marked itself ready."""
    done = signal_the_batch_shell(tmp_path, signame, FAKE_RANKS=ranks)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "srun.argv.signals").read_text() == "USR1\n"
    assert (tmp_path / "srun.argv.scontrol").read_text() == "requeue 7\n"


@pytest.mark.parametrize(("signame", "ranks", "job_state", "status", "requeued"), [
    ("TERM", "killed-on-signal", "RUNNING", 0, True),  # scancel --full --signal=TERM: resume from the last save
    ("TERM", "killed-on-signal-peer-noticed", "RUNNING", 0, True),  # rank 0 recorded its killed peer first
    ("TERM", "killed-on-signal", "COMPLETING", 75, False),  # Slurm is ending the job: its decision stands
    ("USR1", "killed-on-signal", "RUNNING", 137, False),  # srun does not kill on USR1: such ranks failed
    ("USR1", "killed-on-signal-peer-noticed", "RUNNING", 137, False),  # ... and a failure recorded stays one
])
def test_ranks_killed_after_a_term_to_the_whole_job_requeue_it(tmp_path, signame, ranks, job_state, status,
                                                                requeued):
    """TERM to the batch shell and srun together (`scancel --full --signal=TERM`): srun SIGKILLs the
    ranks, which leave no checkpoint and no record -- or, where rank 0 outlived a killed peer by the
    moment it takes to notice, its "failed" record of that peer's loss (seen in a CI run: the job ended
    FAILED). Before: the job ended FAILED; now it is requeued while it still runs, and resumes from its
    last periodic checkpoint."""
    done = signal_the_batch_shell(tmp_path, signame, FAKE_RANKS=ranks, FAKE_JOB_STATE=job_state)
    assert done.returncode == status, done.stdout + done.stderr
    scontrol = tmp_path / "srun.argv.scontrol"
    assert (scontrol.read_text() == "requeue 7\n") if requeued else not scontrol.exists(), done.stderr
    if requeued:
        assert "SIGTERM reached srun too" in done.stderr


# ---- each run its own folder; resuming another run's checkpoint needs RESUME=1 -------------------
def test_training_writes_into_its_own_folder_by_default(tmp_path):
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, OUTPUT_DIR="", **TRAIN_ENV)
    assert result.returncode == 0, result.stderr
    assert argv[argv.index("--save") + 1] == f"{REPO}/runs/gpt-7/checkpoints"  # job 7's own
    assert argv[argv.index("--run-name") + 1] == "gpt-7"  # and its name, not the trainer's "run"


@pytest.mark.parametrize(("output_dir", "name"), [("/x/gpt-20260101-000000-ab12", "gpt-20260101-000000-ab12"),
                                                  ("/x/a run's folder/", "a run's folder")])
def test_training_names_the_run_after_its_folder_unless_run_name_is_set(tmp_path, output_dir, name):
    env = {**TRAIN_ENV, "OUTPUT_DIR": output_dir, "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
           "PROFILE_DIR": str(tmp_path / "traces")}
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, **env)
    assert result.returncode == 0, result.stderr
    assert argv[argv.index("--run-name") + 1] == name
    assert jobs.resolve(jobs.TRAIN, recipes.get("gpt", "cpu"), {"REPO_DIR": str(REPO), **env})["RUN_NAME"] == name
    _result, argv = run_sbatch(jobs.TRAIN, tmp_path, **env, RUN_NAME="mine")
    assert argv[argv.index("--run-name") + 1] == "mine"


def test_the_default_run_folder_is_written_once_and_rendered_from_it():
    """The rule lives in workflows/jobs.py; the sbatch files call the function rendered from it."""
    assert jobs.default_output_dir("/r", "gpt", "7") == "/r/runs/gpt-7"
    for job in jobs.JOBS:
        text = (REPO / "sbatch" / job.filename).read_text()
        function = "default_output_dir() { local JOB_ID=$1; printf '%s\\n' \"${REPO_DIR}\"/runs/\"${MODEL}\"-\"${JOB_ID}\"; }"
        assert text.count(function) == 1, job.filename
        # nowhere else: no other line builds a runs/<model>-... path
        assert [line for line in text.splitlines() if "/runs/" in line and "MODEL" in line] == [function]
    for template in (REPO / "workflows" / "templates").glob("*.j2"):
        assert "/runs/" not in template.read_text(), template
    done = subprocess.run(["bash", "-c", "REPO_DIR=\"/a b/c'd\" MODEL=gpt; " + function + '\ndefault_output_dir 9'],
                          capture_output=True, text=True, timeout=10, check=True)
    assert done.stdout == jobs.default_output_dir("/a b/c'd", "gpt", "9") + "\n"


@pytest.mark.parametrize("tracker", ["latest_checkpointed_iteration.txt", "latest"])  # Megatron-LM's, the old one
@pytest.mark.parametrize(("extra", "refused"), [({}, True), ({"RESUME": "1"}, False),
                                                ({"SLURM_RESTART_COUNT": "1"}, False)])
def test_a_new_job_refuses_another_runs_checkpoint_unless_resume(tmp_path, extra, refused, tracker):
    """Before: every job passed --load and silently continued whatever the folder held."""
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    (tmp_path / "out" / "checkpoints" / tracker).write_text("20\n")
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, **TRAIN_ENV, **extra)
    if refused:
        assert (result.returncode, argv) == (2, []), result.stderr
        assert "already holds a checkpoint (iteration 20) of another run: set RESUME=1" in result.stderr
    else:
        assert result.returncode == 0, result.stderr


def test_aggregation_by_hand_reads_the_folder_of_the_training_job_it_depends_on(tmp_path):
    result, argv = run_sbatch(jobs.AGGREGATE, tmp_path, OUTPUT_DIR="", SLURM_JOB_ID="9",
                              SLURM_JOB_DEPENDENCY="afterany:7")
    assert result.returncode == 0, result.stderr
    assert argv[argv.index("--benchmark_dir") + 1] == f"{REPO}/runs/gpt-7/traces"


def test_gpu_training_without_a_gpu_request_stops_and_names_the_flags(tmp_path):
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, SIZE="gpu", NODE_IPS="10.0.0.1", SLURM_JOB_NUM_NODES="1",
                              SLURM_JOB_ID="7")
    assert result.returncode == 2 and argv == []
    assert "--gpus-per-node=4 --exclusive --wait-all-nodes=1" in result.stderr


def test_gpu_training_sets_the_cuda_and_nccl_environment(tmp_path):
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, SIZE="gpu", NODE_IPS="10.0.0.1", SLURM_JOB_NUM_NODES="1",
                              SLURM_JOB_ID="7", SLURM_GPUS_ON_NODE="4", NCCL_DEBUG="INFO")
    assert result.returncode == 0, result.stderr
    env = dict(line.split("=", 1) for line in (tmp_path / "srun.argv.env").read_text().splitlines() if "=" in line)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["NCCL_DEBUG"] == "INFO"


@pytest.mark.parametrize(("aws", "ours", "flag"), [
    ("TENSOR_PARALLEL", "TP", "--tensor-model-parallel-size"),
    ("PIPELINE_PARALLEL", "PP", "--pipeline-model-parallel-size"),
])
def test_aws_names_are_aliases_and_a_contradiction_is_refused(tmp_path, aws, ours, flag):
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, NODE_IPS="10.0.0.1", **{aws: "1"})
    assert result.returncode == 0, result.stderr
    assert argv[argv.index(flag) + 1] == "1"
    assert jobs.resolve(jobs.TRAIN, recipes.get("gpt"), {"REPO_DIR": str(REPO), aws: "1"})[ours] == "1"
    result, _ = run_sbatch(jobs.TRAIN, tmp_path, NODE_IPS="10.0.0.1", **{aws: "1", ours: "2"})
    assert result.returncode == 2 and f"{aws}=1 and {ours}=2 disagree" in result.stderr


def test_fsx_mount_is_the_container_mounts_alias(tmp_path):
    result, argv = run_sbatch(jobs.PREPROCESS, tmp_path, IMAGE="/img.sqsh", FSX_MOUNT="/fsx:/fsx")
    assert "--container-mounts=/fsx:/fsx" in argv, result.stderr


def test_an_unknown_transport_is_refused_before_srun(tmp_path):
    result, argv = run_sbatch(jobs.TRAIN, tmp_path, NODE_IPS="10.0.0.1", TRANSPORT="rdma")
    assert result.returncode == 2 and argv == []
    assert "TRANSPORT=rdma: not one of auto shm nccl gloo" in result.stderr
