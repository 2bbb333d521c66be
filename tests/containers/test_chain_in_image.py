"""The whole chain inside the enroot image through Pyxis, on the real local two-node cluster.

`python -m workflows.submit gpt --nodes 2 --image <.sqsh> --wait`: preprocessing, DPP training on two
nodes and aggregation each run their srun steps inside the image (Pyxis starts the .sqsh with
squashfuse), the training job's node-address probe included; the outputs land on the host through
the mounts. Nothing here is a stand-in: real enroot, real Pyxis, real Slurm, real training.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.conftest import CLUSTER_DIR, IMAGE
from workflows import slurm

REPO = Path(__file__).resolve().parents[2]
CHAIN_TIMEOUT_S = 900
# The image has its own interpreter; the host has none there (what shows a step ran inside).
IMAGE_PYTHON = "/opt/venv/bin/python3"


def submit(runs_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, str], Path]:
    argv = [sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "2", "--image", str(IMAGE),
            "--wait", "--timeout", str(CHAIN_TIMEOUT_S), "--runs-dir", str(runs_dir), *args]
    proc = subprocess.run(argv, cwd=REPO, env=dict(os.environ), capture_output=True, text=True,
                          timeout=CHAIN_TIMEOUT_S + 60, check=False)
    job_ids = dict(re.findall(r"^(preprocess|train|aggregate)\s+job (\d+)$", proc.stdout, re.M))
    logs = re.search(r"^logs:\s+(\S+)$", proc.stdout, re.M)
    return proc, job_ids, Path(logs.group(1)).parent if logs else Path()


def describe(proc: subprocess.CompletedProcess, run_dir: Path) -> str:
    text = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for log in sorted((run_dir / "logs").glob("*.out")) if run_dir.name else []:
        text += f"\n---- {log.name}\n{log.read_text()[-4000:]}"
    return text


@pytest.fixture
def runs_dir(request) -> Iterator[Path]:
    """A folder under the repository's runs/, where a user's would be (a mounted folder under /tmp works
    too: enroot's tmpfs /tmp lies under the mounts), removed after a passing test and kept for a look
    after a failing one."""
    (REPO / "runs").mkdir(exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="containers-test-", dir=REPO / "runs"))
    yield folder
    if getattr(request.node, "passed", False):
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"\nkept {folder} for a look")


@pytest.mark.timeout(CHAIN_TIMEOUT_S + 120)
@pytest.mark.parametrize("via", ["submitit", "sbatch"])
def test_the_chain_runs_inside_the_image_on_two_nodes(slurm_cluster, runs_dir, via):
    # The mounts are given through --env, as a user on a cluster with a shared file system would.
    # Through plain sbatch the batch scripts are bash alone: no Python runs on the host in any job.
    proc, job_ids, run_dir = submit(runs_dir, "--via", via, "--env", f"CONTAINER_MOUNTS={runs_dir}:{runs_dir}")
    report = describe(proc, run_dir)
    assert proc.returncode == 0, report
    records = {r.job_id: r for r in slurm.query(job_ids=list(job_ids.values()))}
    assert {step: records[job_id].state for step, job_id in job_ids.items()} == {
        "preprocess": "COMPLETED", "train": "COMPLETED", "aggregate": "COMPLETED"}, report

    # The outputs of every step, written inside the containers, are on the host's mounted paths.
    data = run_dir / "data" / "gpt2"
    assert (data / "sample_text_document.bin").stat().st_size > 0, report
    assert (data / "sample_text_document.idx").stat().st_size > 0, report
    checkpoints = run_dir / "checkpoints"  # Megatron-LM's layout: a tracker file and iter_NNNNNNN/
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "20", report
    assert (checkpoints / "iter_0000020").is_dir(), report
    traces = run_dir / "traces"
    assert len(list(traces.glob("trace_rank*.json"))) == 2, report  # one per rank, one rank per node
    summary = json.loads((traces / "summary.json").read_text())
    assert (summary["schedule"], summary["pipeline_parallel"], len(summary["iterations"])) == ("dpp", 2, 20)
    assert (traces / "merged.json").stat().st_size > 0 and (traces / "timeline.png").stat().st_size > 0

    train_log = (run_dir / "logs" / f"mdpp-{run_dir.name}-train_{job_ids['train']}.out").read_text()
    # The probe ran in the image on both nodes and fell back to Slurm's NodeAddr, handed in from the
    # host (the image has no scontrol): node1's loopback address is the rendezvous host.
    assert "MASTER_ADDR=127.0.0.11" in train_log, report
    steps = slurm_steps(job_ids["train"])
    assert steps == [("0", 2), ("1", 1), ("2", 2)], (
        f"expected probe (2 nodes), env (1 node), ranks (2 nodes); sacct steps: {steps}\n{report}")
    # Pyxis started every srun step of the three jobs from the image, on every node of the step.
    started = set()
    for log in (CLUSTER_DIR / "log").glob("slurmd-node*.log"):
        started |= set(re.findall(rf"\[(\d+\.\d+)\] pyxis: starting container from squashfs: {re.escape(str(IMAGE))}$",
                                  log.read_text(), re.M))
    expected = {f"{job_ids['preprocess']}.0", f"{job_ids['aggregate']}.0",
                *(f"{job_ids['train']}.{step}" for step, _ in steps)}
    assert expected <= started, f"steps not started in the image by Pyxis: {sorted(expected - started)}"


def slurm_steps(job_id: str) -> list[tuple[str, int]]:
    """(step number, node count) of a job's srun steps, in order."""
    out = slurm.call(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,NNodes"]).stdout
    steps = []
    for line in out.splitlines():
        step, count = line.split("|")
        suffix = step.partition(".")[2]
        if suffix.isdigit():
            steps.append((suffix, int(count)))
    return sorted(steps, key=lambda s: int(s[0]))


def test_a_step_inside_the_image_runs_the_images_python_with_the_mounts(slurm_cluster, runs_dir):
    """Pyxis runs srun's command in the image: its own Python and package, the workdir, the mounts."""
    shared = runs_dir
    marker = shared / "from-host.txt"
    marker.write_text("host\n")
    script = ("import sys, os, trainer, pathlib; "
              f"print(sys.executable, os.getcwd(), trainer.__file__, pathlib.Path({str(marker)!r}).read_text().strip())")
    proc = slurm.call(["srun", "--nodes=1", "--ntasks=1", f"--container-image={IMAGE}",
                       f"--container-mounts={shared}:{shared}", "--container-workdir=/workspace/megatron-dpp",
                       "python3", "-c", script], timeout=300)
    assert proc.returncode == 0, proc.stderr
    executable, cwd, package, seen = proc.stdout.split()
    assert (executable, cwd, seen) == (IMAGE_PYTHON, "/workspace/megatron-dpp", "host"), proc.stdout
    assert package == "/workspace/megatron-dpp/trainer/__init__.py"
