"""The chain without Slurm: the same three steps on this machine, through submitit's LocalExecutor
(``--via local``: each step a subprocess) or DebugExecutor (``--via debug``: in this process, a
failing step opens pdb post mortem, as submitit's debug mode does).

    python -m workflows.submit gpt --via local --train-iters 4

Each step runs the command its sbatch file would (``jobs.knob_arguments`` over the same knob
values; tests/unit/test_render_sbatch.py holds the files to that argv): the preprocessing and the
aggregation as one process, the training as PP x TP ranks (GPUS_PER_NODE with GPUs) under torchrun
(``--standalone``: a free port on this machine), their lines labelled with the rank in the step's log. The dependencies are the chain's: training only after a
completed preprocessing (else it is CANCELLED before it started), the aggregation after any training.

The run folder is the Slurm chain's (``logs/<job name>_<id>.out``, ``data/``, ``checkpoints/``,
``traces/``, ``submitit/``), plus ``local.json``: each step's job id and state, which
``python -m workflows.status <run folder>`` shows as it shows a Slurm chain.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from trainer.launch.group_stop import stop_group
from workflows import chain, jobs, slurm

MANIFEST = "local.json"
VIAS = ("local", "debug")
NODE = "localhost"


class StepFailed(RuntimeError):
    """A step's command exited non-zero; the message has its status and the last lines of its log."""


def step_command(job: jobs.Job, values: Mapping[str, str]) -> list[str]:
    """``python -m <module> <flags>``: what the job's sbatch file passes to srun (without srun)."""
    argv = ["-m", job.module, *jobs.knob_arguments(job, values)]
    if job is jobs.TRAIN and values.get("EXTRA_TRAIN_ARGS"):
        argv += values["EXTRA_TRAIN_ARGS"].split()
    return argv


def world_size(values: Mapping[str, str]) -> int:
    """Training ranks, as the training file counts them on one node."""
    gpus = int(values.get("GPUS_PER_NODE") or 0)
    return gpus if gpus else int(values["PP"]) * int(values["TP"])


@dataclass(frozen=True)
class LocalStep:
    """submitit callable: run one step's command on this machine, its output into the chain's log."""

    step: str
    argv: tuple[str, ...]
    """``-m <module> ...`` for the interpreter running this callable."""
    ranks: int
    """Processes (1 except for the training)."""
    cwd: str
    """The repository: relative paths in the knob values are relative to it, as in the sbatch files."""
    env: Mapping[str, str]
    logs: str
    job_name: str
    timeout_s: float
    summary_path: str | None = None

    def __call__(self) -> dict[str, Any] | int:
        job_id = submitit.JobEnvironment().job_id
        log = Path(self.logs) / f"{self.job_name}_{job_id}.out"
        argv = [sys.executable, *self.argv]
        if self.ranks > 1:  # torchrun's own agent: a free port, RANK/WORLD_SIZE/LOCAL_*, rank-labelled lines
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.ranks}",
                    "--tee=3", *self.argv]
        with open(log, "a") as out:
            out.write(f"{self.step}: {shlex.join(argv)}\n")
            out.flush()
            proc = subprocess.Popen(argv, cwd=self.cwd, env={**os.environ, **self.env}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                status = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                stop(proc)
                status = 124
                out.write(f"{self.step}: killed after {self.timeout_s:.0f} s (--timeout), every process of it\n")
        if status != 0:
            lines = log.read_text(errors="replace").splitlines()[-20:]
            raise StepFailed(f"{self.step}: exited {status}; the last lines of {log}:\n" + "\n".join(lines))
        if self.summary_path:
            path = Path(self.summary_path)
            return json.loads(path.read_text()) if path.is_file() else {}
        return status


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """TERM the step's whole process group (torchrun and its ranks), KILL what outlives ``grace_s``."""
    stop_group(proc, grace_s)


def executor(via: str, folder: Path) -> submitit.Executor:
    return submitit.DebugExecutor(folder=folder) if via == "debug" else submitit.LocalExecutor(folder=folder)


def records_of(manifest: Mapping[str, Any]) -> list[slurm.JobRecord]:
    """The manifest's steps as the records `workflows.status` shows for a Slurm chain."""
    return [slurm.JobRecord(s["job_id"], s["name"], s["state"], s["exit_code"], s["elapsed"], s["nodes"])
            for s in manifest["steps"]]


def read_manifest(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / MANIFEST).read_text())


def elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def run(spec: chain.ChainSpec, via: str, timeout_s: float,
        on_change: Callable[[slurm.JobRecord, str], None]) -> tuple[list[slurm.JobRecord], dict[str, Any] | None]:
    """Run the three steps in order; each step's record as it ends, and the aggregation's summary."""
    logs = spec.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**spec.environment(), "PYTHONPATH": os.pathsep.join(
        [str(spec.repo_dir), *filter(None, [os.environ.get("PYTHONPATH")])])}
    values = {job.key: jobs.resolve(job, spec.recipe, {**env, "REPO_DIR": str(spec.repo_dir)}) for job in jobs.JOBS}
    manifest: dict[str, Any] = {"name": spec.run_dir.name, "recipe": spec.recipe.key, "via": via, "steps": []}
    folder = spec.run_dir / "submitit"
    summary = None
    saved_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # submitit's local subprocess imports this repository's workflows
    try:
        for job in jobs.JOBS:
            name = chain.job_name(spec.run_dir, job.key)
            entry = {"step": job.key, "name": name, "job_id": "-", "state": "PENDING", "exit_code": "0:0",
                     "elapsed": "00:00:00", "nodes": "None assigned"}
            manifest["steps"].append(entry)
            previous = manifest["steps"][-2] if len(manifest["steps"]) > 1 else None
            if previous and chain.DEPENDENCY[job.key] == "afterok" and previous["state"] != "COMPLETED":
                entry["state"] = "CANCELLED"  # --kill-on-invalid-dep's outcome: it never starts
                write_manifest(spec.run_dir, manifest)
                on_change(records_of(manifest)[-1], job.key)
                continue
            summary_path = str(Path(values[job.key]["PROFILE_DIR"]) / "summary.json") if job is jobs.AGGREGATE else None
            step = LocalStep(job.key, tuple(step_command(job, values[job.key])),
                             world_size(values[job.key]) if job is jobs.TRAIN else 1, str(spec.repo_dir), env,
                             str(logs), name, timeout_s, summary_path)
            started = time.monotonic()
            submitted = executor(via, folder).submit(step)
            entry.update(job_id=str(submitted.job_id), state="RUNNING", nodes=NODE)
            write_manifest(spec.run_dir, manifest)
            on_change(records_of(manifest)[-1], job.key)
            try:
                result = submitted.result()
                entry.update(state="COMPLETED")
                if job is jobs.AGGREGATE and isinstance(result, dict):
                    summary = result
            except Exception as exc:  # the step's failure, reported in its log and the driver's report
                entry.update(state="FAILED", exit_code="1:0", error=str(exc))
            entry["elapsed"] = elapsed(time.monotonic() - started)
            share_outputs([Path(values[job.key][k]) for k in ("DATA_PREFIX", "CHECKPOINT_DIR", "PROFILE_DIR")
                           if values[job.key].get(k)])
            write_manifest(spec.run_dir, manifest)
            on_change(records_of(manifest)[-1], job.key)
    finally:
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path
    return records_of(manifest), summary


def share_outputs(paths: list[Path]) -> None:
    """Files a step wrote private (mkstemp: -rw-------) get the read bits the umask grants, as the
    sbatch files' share_outputs gives them: readable by the group as the rest of the run folder."""
    mask = os.umask(0)
    os.umask(mask)
    bits = 0o044 & ~mask
    for path in paths:
        folder = path if path.is_dir() else path.parent
        for found in folder.rglob("*") if bits and folder.is_dir() else []:
            try:
                info = found.stat()
                if found.is_file() and info.st_uid == os.getuid() and info.st_mode & bits != bits:
                    found.chmod(info.st_mode & 0o7777 | bits)
            except OSError:  # removed meanwhile: nothing to share
                continue


def write_manifest(run_dir: Path, manifest: Mapping[str, Any]) -> None:
    tmp = run_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(run_dir / MANIFEST)


def failures(run_dir: Path) -> list[str]:
    """The error of each step that failed, as recorded in the manifest."""
    return [f"{s['step']} job {s['job_id']}: FAILED\n  {s['error'].replace(chr(10), chr(10) + '  ')}"
            for s in read_manifest(run_dir)["steps"] if s["state"] == "FAILED" and s.get("error")]
