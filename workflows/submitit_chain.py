"""The chain through submitit: each step is a submitit job that runs its rendered sbatch file.

One source of truth for the command line: the job's Python callable, :class:`StepScript`, runs
``bash <the rendered sbatch file>`` — the very bytes committed under sbatch/ — inside the
allocation, with the chain's settings as environment variables. submitit contributes what a shell
script cannot: sbatch parameters from Python, dependencies, the callable's return value (the
aggregation's summary) and the remote traceback of a failed step, both back in the driver.

submitit runs the callable in the batch step (``use_srun=False``): the script's own ``srun`` lines
start the ranks (Pyxis flags included), exactly as under plain sbatch. The batch shell ``exec``s
the submitit process, so Slurm's ``--signal=B:USR1@60`` warning reaches it; StepScript passes USR1
and TERM on to the script, which keeps the training file's exit-record contract (ranks checkpoint,
exit 75, rank 0 writes "checkpointed N", the script requeues its job). A requeued run leaves no
result behind, so the driver keeps following the job until its last run ends.

Nothing here imports torch: the ranks are the script's subprocesses.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from workflows import chain, jobs, render, slurm, sweep
from workflows.sbatch_params import SbatchParams

DEPENDENCY = chain.DEPENDENCY
LOG_TAIL_LINES = 200
TRACEBACK_START = "Traceback (most recent call last):"
SUBMITIT_ERROR_START = TRACEBACK_START  # submitit logs the step's exception after its output
WARNING_SIGNAL = "B:USR1@60"  # the training file's #SBATCH --signal: USR1 to the batch shell, 60 s ahead


class StepFailed(RuntimeError):
    """A step's script exited non-zero; the message carries its exit status and the last traceback."""


def last_traceback(lines: list[str]) -> str | None:
    """The last Python traceback in ``lines`` (through its final 'SomeError: ...' line), or None."""
    starts = [i for i, line in enumerate(lines) if line.rstrip().endswith(TRACEBACK_START)]
    if not starts:
        return None
    block = []
    for line in lines[starts[-1]:]:
        block.append(line.rstrip("\n"))
        # The exception line is the first unindented line after the header (ranks prefix their
        # output with "N: " under srun --label; strip such a prefix before looking).
        body = re.sub(r"^\d+: ", "", line)
        if len(block) > 1 and body[:1] not in (" ", "\t", "") and not body.startswith(TRACEBACK_START):
            break
    return "\n".join(block)


def own_job_id() -> str | None:
    """This job's id for scontrol: an array task's <array>_<task> (its raw id may be the array's own
    id, which scontrol takes for every task), else SLURM_JOB_ID."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def job_restarted() -> bool:
    """Whether this job was requeued while running (its state is no longer RUNNING)."""
    job_id = own_job_id()
    if not job_id:
        return False
    try:
        text = slurm.run(["scontrol", "show", "job", "--oneliner", job_id])
    except slurm.SlurmError:
        return False
    state = re.search(r"\bJobState=(\S+)", text)
    return bool(state) and state.group(1) != "RUNNING"


@dataclass(frozen=True)
class StepScript:
    """submitit callable: run one rendered sbatch file with bash; return the step's result."""

    step: str
    """preprocess, train or aggregate."""
    script: str
    """The rendered sbatch file (a copy under the run folder, byte-identical to sbatch/)."""
    env: Mapping[str, str]
    """The chain's settings, on top of the batch step's environment (SLURM_* included)."""
    summary_path: str | None = None
    """aggregate: summary.json it writes, returned to the driver."""

    def __call__(self) -> dict[str, Any] | int:
        proc = subprocess.Popen(["bash", self.script], env={**os.environ, **self.env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

        def forward(signum: int, _frame: object) -> None:
            # The script traps USR1 and TERM itself (and passes them on to srun as USR1).
            if proc.poll() is None:
                proc.send_signal(signum)

        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, forward)
        tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        assert proc.stdout is not None
        for line in proc.stdout:  # tee into the job's log, keep the tail for a failure report
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line)
        status = proc.wait()
        if job_restarted():
            # The script requeued its job ("checkpointed"), or Slurm did: this run is over, the next
            # one reruns this callable. No result file, or the driver would take this run as the end.
            sys.stdout.flush()
            os._exit(0 if status == 0 else 75)
        if status != 0:
            lines = list(tail)
            traceback = last_traceback(lines)
            raise StepFailed(f"{self.step}: `bash {self.script}` exited {status}"
                             + (f"; the last traceback in its output:\n{traceback}" if traceback else
                                "; no Python traceback in its output, last lines:\n" + "".join(lines[-20:])))
        if self.summary_path:
            path = Path(self.summary_path)
            return json.loads(path.read_text()) if path.is_file() else {}
        return status


class ExecingSlurmExecutor(submitit.SlurmExecutor):
    """SlurmExecutor whose batch script ``exec``s the submitit process.

    Then Slurm's batch-shell signal (--signal=B:USR1@60) reaches StepScript, which forwards it; a
    non-exec'ed bash would die of an untrapped USR1 instead, taking the step down uncheckpointed.
    """

    @property
    def _submitit_command_str(self) -> str:
        return "exec " + super()._submitit_command_str


def step_parameters(spec: chain.ChainSpec, params: SbatchParams, step: str, logs: Path,
                    after: str | None) -> dict[str, Any]:
    """submitit's update_parameters for one step: what chain.sbatch_options gives plain sbatch, and more."""
    job = next(j for j in jobs.JOBS if j.key == step)
    extra: dict[str, object] = {
        "output": f"{logs}/%x_%j.out",  # the same log names as plain `sbatch` (and workflows.status)
        "chdir": str(spec.repo_dir),
        "time": job.time_limit,
        "open-mode": "append",
    }
    parameters: dict[str, Any] = {
        "job_name": chain.job_name(spec.run_dir, step),
        "use_srun": False,
        "stderr_to_stdout": True,
        "nodes": 1,
        "ntasks_per_node": 1,
    }
    if spec.partition:
        parameters["partition"] = spec.partition
    if step == "preprocess":
        parameters["cpus_per_task"] = int(spec.overrides.get("WORKERS") or spec.recipe.preprocess_workers)
        extra.update(params.shared())
    elif step == "train":
        parameters.update(nodes=spec.nodes, ntasks_per_node=spec.ranks // spec.nodes,
                          cpus_per_task=params.cpus_per_task or 1)
        extra.update({"requeue": True, "signal": WARNING_SIGNAL})
        extra.update(params.training())
    else:
        extra.update(params.shared())
    if after:
        extra.update({"dependency": after, "kill-on-invalid-dep": "yes"})
    parameters["additional_parameters"] = extra
    return parameters


@dataclass
class SubmittedChain:
    """The chain's submitit jobs, with the plain view chain.wait and workflows.status use."""

    chain: chain.Chain
    jobs: dict[str, submitit.Job]


def submit(spec: chain.ChainSpec, params: SbatchParams) -> SubmittedChain:
    """Render the sbatch files into the run folder and submit each through submitit, chained.

    A failed submission cancels the jobs already submitted: no half chain is left behind.
    """
    slurm.require("sbatch")  # before submitit's own check, whose message does not say what to do
    logs = spec.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rendered = render.render_all()
    if render.drift(rendered, render.SBATCH_DIR):
        chain.log.warning("sbatch/ differs from the templates (submitting the fresh render); %s", render.HINT)
    scripts = {path.name: path for path in render.write(rendered, spec.run_dir / "sbatch")}
    env = spec.environment()
    profile_dir = jobs.resolve(jobs.AGGREGATE, spec.recipe, {**env, "REPO_DIR": str(spec.repo_dir)})["PROFILE_DIR"]
    executor = ExecingSlurmExecutor(folder=spec.run_dir / "submitit")
    submitted: dict[str, submitit.Job] = {}
    previous = None
    try:
        for job in jobs.JOBS:
            after = f"{DEPENDENCY[job.key]}:{previous.job_id}" if previous else None
            executor.update_parameters(**step_parameters(spec, params, job.key, logs, after))
            summary = str(Path(profile_dir) / "summary.json") if job.key == "aggregate" else None
            previous = executor.submit(StepScript(job.key, str(scripts[job.filename]), env, summary))
            submitted[job.key] = previous
    except (subprocess.CalledProcessError, OSError, RuntimeError, ValueError) as exc:
        slurm.scancel([j.job_id for j in submitted.values()])
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise slurm.SlurmError(f"submitting through submitit failed: {lines[-1]}") from exc  # one line
    return SubmittedChain(chain.Chain({k: j.job_id for k, j in submitted.items()}, spec.run_dir), submitted)


def log_path(submitted: chain.Chain, step: str) -> Path:
    return submitted.run_dir / "logs" / f"{chain.job_name(submitted.run_dir, step)}_{submitted.job_ids[step]}.out"


def failure_report(submitted: SubmittedChain, step: str, record: slurm.JobRecord, tail_lines: int = 30) -> str:
    """State, exit code, the log's tail and the remote traceback of a step that did not complete."""
    return job_report(step, record, log_path(submitted.chain, step),
                      remote_error(submitted.jobs[step]), tail_lines)


def job_report(what: str, record: slurm.JobRecord, log: Path, error: str | None, tail_lines: int = 30) -> str:
    """``what`` job <id>: state, exit code; the log's tail (without submitit's copy of ``error``); ``error``."""
    out = [f"{what} job {record.job_id}: {record.state}, exit code {record.exit_code}"]
    if log.is_file():
        lines = log.read_text(errors="replace").splitlines()
        if error:  # the step's own output only: submitit's copy of the traceback follows below
            lines = [line for line in lines if not line.startswith("submitit ")]
            ends = [i for i, line in enumerate(lines) if line.startswith(SUBMITIT_ERROR_START)]
            lines = lines[: ends[-1]] if ends else lines
        out.append(f"  last {min(tail_lines, len(lines))} lines of {log}:")
        out += [f"    {line}" for line in lines[-tail_lines:]]
    else:
        out.append(f"  no log ({log} was never written: the job did not start)")
    if error:
        out.append("  remote traceback (submitit):")
        out += [f"    {line}" for line in error.splitlines()]
    return "\n".join(out)


def remote_error(job: submitit.Job) -> str | None:
    """The pickled exception of a job that raised (FailedJobError's text), None without one."""
    return remote_error_at(job.paths.result_pickle)


def result_pickle(folder: Path, job_id: str) -> Path:
    """Where submitit's job ``job_id`` (``12`` or an array task's ``12_1``) leaves its result."""
    return submitit.core.utils.JobPaths(folder, job_id=job_id, task_id=0).result_pickle


def remote_error_at(path: Path) -> str | None:
    """The exception pickled at ``path`` by a job that raised, None without one."""
    if not path.exists():
        return None  # never ran (cancelled by its dependency), or killed before it could write
    try:
        outcome, value = submitit.core.utils.pickle_load(path)
    except Exception as exc:  # a half-written pickle must not hide the rest of the report
        return f"(could not read {path}: {exc})"
    return str(value) if outcome == "error" else None


def aggregation_result(job: submitit.Job) -> dict[str, Any] | None:
    """The aggregation step's return value (summary.json's content), None when it did not return one."""
    if not job.paths.result_pickle.exists():
        return None
    outcome, value = submitit.core.utils.pickle_load(job.paths.result_pickle)
    return value if outcome == "success" and isinstance(value, dict) else None


def format_summary(summary: Mapping[str, Any]) -> str:
    """A few lines: schedule, iteration time, bubble, each stage's busy/idle."""
    if not summary:
        return "aggregation returned no summary (no traces?)"
    lines = [
        f"summary: {summary.get('schedule')} PP={summary.get('pipeline_parallel')} "
        f"microbatches={summary.get('num_microbatches')} iterations={len(summary.get('iterations', []))}",
        f"  iteration time {summary.get('mean_iteration_time_ms', float('nan')):.2f} ms (mean), "
        f"bubble {summary.get('bubble_fraction', float('nan')):.4f} "
        f"(1F1B theory {summary.get('theoretical_1f1b_bubble', float('nan')):.4f})",
    ]
    for stage in summary.get("stages", []):
        lines.append(f"  stage {stage['stage']}: busy {stage['busy_ms']:.2f} ms, idle {stage['idle_ms']:.2f} ms, "
                     f"bubble {stage['bubble_fraction']:.4f}, peak in-flight {stage['peak_inflight']}")
    balance = summary.get("stage_balance")
    if balance:  # trainer/schedule/stage_balance.py's fit; the aggregation log has the whole of it
        if not balance["persistent"]:
            lines.append("  stage balance: no stage persistently slowest")
        else:
            line = f"  stage balance: stage {balance['slowest']} persistently slowest ({balance['excess']:+.0%})"
            best = balance["best"]
            if balance["recommend"]:
                line += (f"; re-split {'/'.join(map(str, best['layers']))}: {' '.join(best['flags']) or '(even)'} "
                         f"(slowest stage {-balance['gain']:+.0%} predicted)")
            lines.append(line)
    return "\n".join(lines)



@dataclass
class SubmittedSweep:
    """A sweep's submitit jobs and its manifest (sweep.json, what workflows.status reads)."""

    sweep_dir: Path
    manifest: dict[str, Any]
    jobs: dict[str, submitit.Job]
    """Job id -> submitit job (preprocess, every training task, every aggregation)."""


def submit_sweep(base: chain.ChainSpec, runs: list[tuple[sweep.Point, chain.ChainSpec]],
                 params: SbatchParams) -> SubmittedSweep:
    """Preprocess once (``base``), train every point as a job array, aggregate each point on its own.

    Points whose training allocations differ (PP x TP ranks per node) go in one array each: an array
    shares its sbatch parameters. Each aggregation waits (afterany) for its own array task. A failed
    submission cancels what was already submitted.
    """
    slurm.require("sbatch")
    sweep_dir = base.run_dir
    logs = sweep_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rendered = render.render_all()
    if render.drift(rendered, render.SBATCH_DIR):
        chain.log.warning("sbatch/ differs from the templates (submitting the fresh render); %s", render.HINT)
    scripts = {path.name: str(path) for path in render.write(rendered, sweep_dir / "sbatch")}
    script = {job.key: scripts[job.filename] for job in jobs.JOBS}
    executor = ExecingSlurmExecutor(folder=sweep_dir / "submitit")
    submitted: dict[str, submitit.Job] = {}

    def parameters(spec: chain.ChainSpec, step: str, after: str | None) -> dict[str, Any]:
        out = step_parameters(spec, params, step, logs, after)
        out["job_name"] = sweep.job_name(sweep_dir, step)
        return out

    try:
        executor.update_parameters(**parameters(base, "preprocess", None))
        pre = executor.submit(StepScript("preprocess", script["preprocess"], base.environment()))
        submitted[pre.job_id] = pre
        groups: dict[str, list[tuple[sweep.Point, chain.ChainSpec]]] = {}
        for point, spec in runs:  # one array per distinct training allocation
            key = json.dumps(parameters(spec, "train", None), sort_keys=True, default=str)
            groups.setdefault(key, []).append((point, spec))
        train_jobs: dict[str, submitit.Job] = {}
        for members in groups.values():
            train_parameters = parameters(members[0][1], "train", f"afterok:{pre.job_id}")
            if len(members) > 1:  # a real array: name each task's log by its <array>_<task> id
                train_parameters["additional_parameters"]["output"] = f"{logs}/%x_%A_%a.out"
            executor.update_parameters(**train_parameters)
            with executor.batch():
                delayed = [executor.submit(StepScript("train", script["train"], spec.environment()))
                           for _point, spec in members]
            for (point, _spec), job in zip(members, delayed, strict=True):
                train_jobs[point.label] = submitted[job.job_id] = job
        manifest_points = []
        for point, spec in runs:
            train = train_jobs[point.label]
            executor.update_parameters(**parameters(spec, "aggregate", f"afterany:{train.job_id}"))
            summary = str(spec.run_dir / "traces" / "summary.json")
            agg = executor.submit(StepScript("aggregate", script["aggregate"], spec.environment(), summary))
            submitted[agg.job_id] = agg
            manifest_points.append({"label": point.label, "description": point.description,
                                    "config": point.config, "overrides": point.overrides,
                                    "run_dir": str(spec.run_dir), "train": train.job_id, "aggregate": agg.job_id})
    except (subprocess.CalledProcessError, OSError, RuntimeError, ValueError) as exc:
        slurm.scancel(list(submitted))
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise slurm.SlurmError(f"submitting the sweep through submitit failed: {lines[-1]}") from exc
    manifest = {"name": sweep_dir.name, "recipe": f"{base.recipe.model}/{base.recipe.size}",
                "nodes": base.nodes, "preprocess": pre.job_id, "logs": str(logs),
                "submitit": str(sweep_dir / "submitit"), "points": manifest_points}
    sweep.write_manifest(sweep_dir, manifest)
    return SubmittedSweep(sweep_dir, manifest, submitted)


def sweep_failure_reports(manifest: Mapping[str, Any], records: Mapping[str, slurm.JobRecord],
                          tail_lines: int = 30) -> list[str]:
    """A report (state, exit code, log tail, remote traceback) for each finished job that did not complete."""
    folder = sweep.submitit_folder(manifest)
    reports = []
    for what, step, job_id in sweep.jobs_of(manifest):
        record = sweep.record_of(records, job_id)
        if record is None or not record.finished or record.state == "COMPLETED" or record.never_ran:
            continue  # a job that never ran has no log nor traceback: sweep.never_started names it
        reports.append(job_report(what, record, sweep.log_path(manifest, step, job_id),
                                  remote_error_at(result_pickle(folder, job_id)), tail_lines))
    return reports
