"""Submit the three sbatch files as one chain and follow it in sacct.

preprocess -> train (afterok) -> aggregate (afterany), every dependency with --kill-on-invalid-dep,
so a failed step cancels what can no longer run instead of leaving it pending forever. The files
submitted are the renders of workflows/templates (byte-identical to sbatch/ when that is up to
date); the chain's settings travel as the environment variables those files read.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from trainer.problems import raise_if_any
from workflows import jobs, render, slurm
from workflows.recipes import Recipe
from workflows.sbatch_params import SbatchParams, as_flags

log = logging.getLogger(__name__)

STEPS = tuple(job.key for job in jobs.JOBS)  # preprocess, train, aggregate
NAME_PREFIX = "mdpp-"
DEPENDENCY = {"preprocess": None, "train": "afterok", "aggregate": "afterany"}  # on the step before


@dataclass(frozen=True)
class ChainSpec:
    """What to run and where; validated before anything is submitted or written."""

    recipe: Recipe
    """Recipe whose defaults the sbatch files use (MODEL/SIZE)."""
    nodes: int
    """Nodes of the training job."""
    repo_dir: Path
    """Repository (or shared copy of it) the jobs cd into."""
    run_dir: Path
    """Folder for this chain's logs, rendered scripts, checkpoints and traces."""
    gpus_per_node: int = 0
    """GPUs per node; > 0 also adds --gpus-per-node to the training job."""
    partition: str | None = None
    """Slurm partition of all three jobs (None: the cluster's default)."""
    image: str | None = None
    """Container image for Pyxis (None: the host environment)."""
    overrides: Mapping[str, str] = field(default_factory=dict)
    """Knob values (TRAIN_ITERS=..., DATA_PATH=...) that replace the recipe's defaults."""

    def __post_init__(self) -> None:
        errors = []
        if self.nodes < 1:
            errors.append(f"--nodes {self.nodes}: must be >= 1")
        if self.gpus_per_node < 0:
            errors.append(f"--gpus-per-node {self.gpus_per_node}: must be >= 0")
        known = jobs.KNOB_NAMES | set(jobs.SCRIPT_VARIABLES)
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            errors.append(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        errors += jobs.value_problems(self.overrides)
        try:
            ranks = self.ranks if self.nodes >= 1 else 0
        except ValueError:  # a bad PP, TP or GPUS_PER_NODE, named above
            ranks = 0
        if ranks % max(self.nodes, 1):
            errors.append(f"{self.ranks} training ranks (PP={self._knob('PP')} x TP={self._knob('TP')}) do not "
                          f"split evenly over --nodes {self.nodes}")
        raise_if_any(errors)

    def _knob(self, name: str) -> int:
        value = self.overrides.get(name) or str(jobs.defaults(self.recipe)[name])
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
        return int(value)

    @property
    def ranks(self) -> int:
        """Training ranks: one per GPU, or PP x TP CPU ranks (what the training sbatch file starts)."""
        gpus = self.gpus_per_node or int(self.overrides.get("GPUS_PER_NODE") or 0)
        return self.nodes * gpus if gpus else self._knob("PP") * self._knob("TP")

    def environment(self) -> dict[str, str]:
        """Variables the sbatch files read, on top of the caller's environment."""
        env = {
            "MODEL": self.recipe.model,
            "SIZE": self.recipe.size,
            "REPO_DIR": str(self.repo_dir),
            "OUTPUT_DIR": str(self.run_dir),
            # Each chain tokenizes into its own folder: two chains never rewrite a dataset in use.
            "DATA_PATH": str(self.run_dir / "data"),
        }
        if self.gpus_per_node:
            env["GPUS_PER_NODE"] = str(self.gpus_per_node)
        if self.image:
            env["IMAGE"] = self.image
        env.update(self.overrides)
        return env

    def missing_inputs(self) -> list[str]:
        """Input files (corpus, vocabulary, merges) the jobs would not find, as 'KNOB=path' strings.

        Inside a container the paths are the image's, which the login node cannot check.
        """
        if self.image:
            return []
        values = jobs.resolve(jobs.PREPROCESS, self.recipe, {**self.environment(), "REPO_DIR": str(self.repo_dir)})
        missing = []
        for knob in ("INPUT", "VOCAB_FILE", "MERGE_FILE"):
            value = values[knob]
            if value and not (self.repo_dir / value).is_file():
                missing.append(f"{knob}={value}")
        return missing


@dataclass(frozen=True)
class Chain:
    """A submitted chain: step name -> job id, plus where its files go."""

    job_ids: dict[str, str]
    """preprocess/train/aggregate -> Slurm job id."""
    run_dir: Path
    """The chain's folder (logs/, sbatch/, checkpoints/, traces/, data/)."""

    @property
    def ids(self) -> list[str]:
        return [self.job_ids[step] for step in STEPS]


def new_run_dir(root: Path, recipe: Recipe) -> Path:
    """A fresh, unique folder name such as runs/gpt-20261126-021500-3fa2."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return root / f"{recipe.model}-{stamp}-{secrets.token_hex(2)}"


def job_name(run_dir: Path, step: str) -> str:
    """mdpp-<run folder>-<step>: `workflows.status` finds a chain's siblings by these names."""
    return f"{NAME_PREFIX}{run_dir.name}-{step}"


def chain_names(name: str) -> list[str] | None:
    """The three job names of the chain a job named ``name`` belongs to (None: not a chain job)."""
    for step in STEPS:
        suffix = f"-{step}"
        if name.startswith(NAME_PREFIX) and name.endswith(suffix) and len(name) > len(NAME_PREFIX + suffix):
            stem = name[: -len(suffix)]
            return [f"{stem}-{s}" for s in STEPS]
    return None


def waited_for(kind: str, job_id: str, what: str, state: str) -> str:
    """Why a job that never ran did not: its dependency ``kind:job_id`` on ``what`` (now ``state``)."""
    if kind == "afterok" and state in slurm.TERMINAL_STATES and state != "COMPLETED":
        return f": its dependency {kind}:{job_id} can never be met ({what} job {job_id} ended {state})"
    return f", while waiting for {kind}:{job_id} ({what} job {job_id} {state})"


def never_started(records: list[slurm.JobRecord]) -> list[str]:
    """One line per job of a chain (``records`` in chain order) that ended without ever running,
    naming the dependency it waited for (each step waits for the one before it)."""
    return [f"{step} job {record.job_id}: {record.state} before it started"
            + waited_for(DEPENDENCY[step] or "", previous.job_id, previous_step, previous.state)
            for record, previous, step, previous_step in zip(records[1:], records, STEPS[1:], STEPS, strict=False)
            if record.never_ran]


def sbatch_options(spec: ChainSpec, step: str, logs: Path, after: str | None,
                   params: SbatchParams | None = None) -> list[str]:
    """sbatch flags of one step: name, log file, directory, partition; nodes/GPUs and the dependency."""
    params = params or SbatchParams(gpus_per_node=spec.gpus_per_node)
    options = [
        f"--job-name={job_name(spec.run_dir, step)}",
        f"--output={logs}/%x_%j.out",
        f"--chdir={spec.repo_dir}",
    ]
    if spec.partition:
        options.append(f"--partition={spec.partition}")
    if step == "preprocess":  # one core per tokenizer worker (the file's directive is the CPU demo's)
        options.append(f"--cpus-per-task={spec.overrides.get('WORKERS') or spec.recipe.preprocess_workers}")
    if step == "train":
        # Ask for every rank's slot: an allocation of one task per node refuses the srun of several
        # ranks per node ("More processors requested than permitted") unless whole nodes are given.
        options += [f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.ranks // spec.nodes}",
                    f"--cpus-per-task={params.cpus_per_task or 1}"]
        options += as_flags(params.training())  # GPU runs: --gpus-per-node, --exclusive, --wait-all-nodes=1
    else:
        options += as_flags(params.shared())
    if after:
        options += [f"--dependency={after}", "--kill-on-invalid-dep=yes"]
    return options


def submit(spec: ChainSpec, params: SbatchParams | None = None) -> Chain:
    """Render the sbatch files into the run folder and submit them as a chain.

    If any submission fails, the jobs already submitted are cancelled: no half chain is left behind.
    """
    logs = spec.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rendered = render.render_all()
    if render.drift(rendered, render.SBATCH_DIR):
        log.warning("sbatch/ differs from the templates (submitting the fresh render); %s", render.HINT)
    scripts = {path.name: path for path in render.write(rendered, spec.run_dir / "sbatch")}
    env = {**os.environ, **spec.environment()}
    job_ids: dict[str, str] = {}
    previous = None
    try:
        for job in jobs.JOBS:
            after = f"{DEPENDENCY[job.key]}:{previous}" if previous else None
            previous = slurm.sbatch(str(scripts[job.filename]), sbatch_options(spec, job.key, logs, after, params), env)
            job_ids[job.key] = previous
    except slurm.SlurmError:
        slurm.scancel(list(job_ids.values()))
        raise
    return Chain(job_ids, spec.run_dir)


def wait(
    chain: Chain,
    timeout_s: float,
    on_change: Callable[[slurm.JobRecord, str], None],
    poll_s: float = 2.0,
) -> list[slurm.JobRecord]:
    """Poll sacct until every job of the chain has finished; report each state change.

    ``on_change(record, step)`` is called whenever a job's state differs from the last poll.
    Raises TimeoutError naming the unfinished jobs after ``timeout_s``.
    """
    steps = {job_id: step for step, job_id in chain.job_ids.items()}
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        records = {r.job_id: r for r in slurm.query(job_ids=chain.ids)}
        for job_id in chain.ids:
            record = records.get(job_id)
            if record and seen.get(job_id) != record.state:
                seen[job_id] = record.state
                on_change(record, steps[job_id])
        if len(records) == len(chain.ids) and all(r.finished for r in records.values()):
            return [records[i] for i in chain.ids]
        if time.monotonic() > deadline:
            waiting = [f"{steps[i]} {i} ({seen.get(i, 'not in sacct yet')})" for i in chain.ids
                       if not (i in records and records[i].finished)]
            raise TimeoutError(f"chain not finished after {timeout_s:.0f} s: {', '.join(waiting)}")
        time.sleep(poll_s)
