"""Sweeps: one preprocessing job, a job array of training runs, one aggregation per run.

    python -m workflows.submit gpt --nodes 2 --sweep pp=2,4 --sweep schedule=1f1b,dpp

``--sweep KEY=V1,V2,...`` (repeatable) names a training setting and its values; the sweep is the
cartesian product, in the order given. KEY is a training knob of the sbatch file (``PP``,
``NUM_LAYERS``, ``MICRO_BATCH_SIZE``, ... in any case), an AWS alias (``PIPELINE_PARALLEL``) or one
of the short names below; ``schedule`` takes ``1f1b`` or ``dpp`` (``USE_DPP=0/1``). Everything is
validated before anything is submitted, and every problem is named in one message.

The sweep's folder ``runs/<model>-<date>-<time>-<hex>/`` holds ``sweep.json`` (this module's
manifest: each point's configuration, folder and job ids), ``data/`` (the one dataset), ``logs/``
and one folder per point (``pp-2_schedule-1f1b/``: checkpoints/, traces/ with summary.json). Each
job's log is ``logs/<job name>_<id>.out``, an array task's id being ``<array>_<task>``.
Its jobs are named ``mdppsweep-<folder>-<step>``, so ``workflows.status`` finds the manifest from
any id. Nothing here imports submitit or torch (workflows/submitit_chain.py submits).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workflows import chain, jobs, slurm

NAME_PREFIX = "mdppsweep-"  # not "mdpp-": chain.chain_names must not take a sweep job for a chain
MANIFEST = "sweep.json"
MAX_POINTS = 64
SHORT_NAMES = {"pp": "PP", "tp": "TP", "schedule": "USE_DPP", "layers": "NUM_LAYERS",
               "mbs": "MICRO_BATCH_SIZE", "gbs": "GLOBAL_BATCH_SIZE"}
SCHEDULES = {"1f1b": "0", "dpp": "1"}
# Training knobs a sweep may vary. Paths and the dataset are the sweep's (one preprocessing run).
NOT_SWEPT = {"DATA_PATH", "OUTPUT_DIR", "IMAGE", "CONTAINER_WORKDIR", "PYTHON", "DATA_PREFIX", "DATASET",
             "CHECKPOINT_DIR", "PROFILE_DIR", "RUN_NAME", "RESUME", "EXTRA_TRAIN_ARGS",
             "TOKENIZER_TYPE", "VOCAB_FILE", "MERGE_FILE"}
SWEEPABLE = tuple(k.env for k in jobs.TRAIN.knobs if k.env not in NOT_SWEPT)
VALUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+-]*$")  # also a folder name part: no '/', '_', '=', space


@dataclass(frozen=True)
class Axis:
    """One --sweep option: the name as typed, the knob it sets, its values as typed."""

    key: str
    knob: str
    values: tuple[str, ...]

    def knob_value(self, value: str) -> str:
        return SCHEDULES[value] if self.knob == "USE_DPP" and value in SCHEDULES else value


@dataclass(frozen=True)
class Point:
    """One training run of the sweep."""

    config: dict[str, str]
    """Axis key (as typed) -> value (as typed), in axis order."""
    overrides: dict[str, str]
    """Knob -> value for the sbatch file."""

    @property
    def label(self) -> str:
        """Folder name, e.g. pp-2_schedule-1f1b."""
        return "_".join(f"{key.lower()}-{value}" for key, value in self.config.items())

    @property
    def description(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.config.items())


def knob_of(key: str) -> str | None:
    """The training knob a --sweep key names (None: not a sweepable setting)."""
    name = SHORT_NAMES.get(key.lower()) or jobs.ALIASES.get(key.upper()) or key.upper()
    return name if name in SWEEPABLE else None


def value_problem(axis_key: str, knob: str, value: str) -> str | None:
    if not VALUE.match(value):
        return f"--sweep {axis_key}: value {value!r} must be letters, digits, '.', '+' or '-'"
    if knob == "USE_DPP":
        if value not in SCHEDULES and value not in ("0", "1"):
            return f"--sweep {axis_key}: {value!r} is not one of 1f1b, dpp (or 0, 1)"
        return None
    problem = jobs.value_problem(knob, value)
    return f"--sweep {axis_key}: {problem}" if problem else None


def parse(texts: Sequence[str], fixed: Mapping[str, str] | None = None) -> tuple[list[Axis], list[str]]:
    """--sweep KEY=V1,V2 options -> axes, and every problem found (none when the list is empty).

    ``fixed``: the knobs already set by --env/--train-iters (a knob set there cannot also be swept).
    """
    fixed = fixed or {}
    axes: list[Axis] = []
    problems: list[str] = []
    seen: dict[str, str] = {}
    for text in texts:
        key, sep, values_text = text.partition("=")
        key = key.strip()
        values = tuple(v.strip() for v in values_text.split(","))
        if not sep or not key or not values_text.strip():
            problems.append(f"--sweep {text!r}: expected KEY=VALUE[,VALUE...]")
            continue
        knob = knob_of(key)
        if knob is None:
            problems.append(f"--sweep {key}: not a training setting one can sweep; one of "
                            f"{', '.join(sorted(SHORT_NAMES))} or {', '.join(SWEEPABLE)}")
            continue
        if knob in seen:
            problems.append(f"--sweep {key}: {knob} is already swept by --sweep {seen[knob]}")
            continue
        seen[knob] = key
        if knob in fixed:
            problems.append(f"--sweep {key}: {knob} is also set to {fixed[knob]} (--env/--train-iters): set one")
        if "" in values:
            problems.append(f"--sweep {key}: empty value in {values_text!r}")
        duplicates = sorted({v for v in values if values.count(v) > 1})
        if duplicates:
            problems.append(f"--sweep {key}: value(s) given twice: {', '.join(duplicates)}")
        problems += [p for v in values if v and (p := value_problem(key, knob, v))]
        axes.append(Axis(key, knob, values))
    if axes:
        count = 1
        for axis in axes:
            count *= len(axis.values)
        if count > MAX_POINTS:
            problems.append(f"--sweep: {count} runs, more than {MAX_POINTS}; split the sweep")
    return axes, problems


def points(axes: Sequence[Axis]) -> list[Point]:
    """The cartesian product of the axes, first axis slowest."""
    out = []
    for combo in itertools.product(*(axis.values for axis in axes)):
        config = {axis.key: value for axis, value in zip(axes, combo, strict=True)}
        overrides = {axis.knob: axis.knob_value(value) for axis, value in zip(axes, combo, strict=True)}
        out.append(Point(config, overrides))
    return out


def job_name(sweep_dir: Path, step: str) -> str:
    return f"{NAME_PREFIX}{sweep_dir.name}-{step}"


def sweep_of(name: str) -> str | None:
    """The sweep folder's name from one of its job names (None: not a sweep job)."""
    match = re.match(rf"^{re.escape(NAME_PREFIX)}(.+)-(preprocess|train|aggregate)$", name)
    return match.group(1) if match else None


def write_manifest(sweep_dir: Path, manifest: Mapping[str, Any]) -> Path:
    path = sweep_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def jobs_of(manifest: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(what, step, job id) of every job: ("preprocess", ...), ("train pp=2", ...), ("aggregate pp=2", ...)."""
    out = [("preprocess", "preprocess", manifest["preprocess"])]
    for point in manifest["points"]:
        out += [(f"{step} {point['description']}", step, point[step]) for step in ("train", "aggregate")]
    return out


def job_ids(manifest: Mapping[str, Any]) -> list[str]:
    return [job_id for _what, _step, job_id in jobs_of(manifest)]


def log_path(manifest: Mapping[str, Any], step: str, job_id: str) -> Path:
    """A job's log: logs/<job name>_<id>.out, an array task's id being <array>_<task> (%x_%A_%a)."""
    return Path(manifest["logs"]) / f"{NAME_PREFIX}{manifest['name']}-{step}_{job_id}.out"


def submitit_folder(manifest: Mapping[str, Any]) -> Path:
    """submitit's folder (pickled callables, results, remote tracebacks)."""
    return Path(manifest.get("submitit") or Path(manifest["logs"]).parent / "submitit")


def summary_of(point: Mapping[str, Any]) -> dict[str, Any] | None:
    path = Path(point["run_dir"]) / "traces" / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def records_by_id(records: Sequence[slurm.JobRecord]) -> dict[str, slurm.JobRecord]:
    return {r.job_id: r for r in records}


def query_ids(ids: Sequence[str]) -> list[str]:
    """``ids`` and the array id of each array task among them: sacct has no row ``12_1`` for a task
    that never ran, only the array's one line ``12_[0-1]``, which `sacct -j 12` finds."""
    arrays = [i.partition("_")[0] for i in ids if "_" in i]
    return list(dict.fromkeys([*ids, *arrays]))


def query(manifest: Mapping[str, Any]) -> dict[str, slurm.JobRecord]:
    """sacct's records of every job of the sweep, array tasks that never ran included."""
    records = records_by_id(slurm.query(job_ids=query_ids(job_ids(manifest))))
    return {**records, **vanished_tasks(manifest, records)}


def vanished_tasks(manifest: Mapping[str, Any], records: Mapping[str, slurm.JobRecord]) -> dict[str, slurm.JobRecord]:
    """Array tasks cancelled while the rest of their array waited or ran: sacct keeps no row of
    their own (and, once another task has run, no ``12_[...]`` line either) and slurmctld forgets
    them; each is given a CANCELLED record that says it never ran, rather than staying UNKNOWN."""
    out: dict[str, slurm.JobRecord] = {}
    by_array: dict[str, list[str]] = {}
    for point in manifest["points"]:
        array, _, task = point["train"].partition("_")
        record = record_of(records, point["train"])
        own_row = point["train"] in records
        if task.isdigit() and not own_row and (record is None or not record.finished):
            by_array.setdefault(array, []).append(point["train"])
    for array, tasks in by_array.items():
        known = [r for i, r in records.items() if i.partition("_")[0] == array]
        if not known:
            continue  # sacct does not know the array yet: just submitted
        held = slurm.array_tasks(array)
        for task_id in tasks if held is not None else []:
            if int(task_id.partition("_")[2]) not in held:
                out[task_id] = slurm.JobRecord(task_id, known[0].name, "CANCELLED", "0:0", "00:00:00", "None assigned")
    return out


def dependency_of(manifest: Mapping[str, Any], job_id: str) -> tuple[str, str, str] | None:
    """(kind, job id, what) of the job ``job_id`` waited for: a training task waits (afterok) for
    the preprocessing, an aggregation (afterany) for its training task; None for the preprocessing."""
    for point in manifest["points"]:
        if point["train"] == job_id:
            return "afterok", manifest["preprocess"], "preprocess"
        if point["aggregate"] == job_id:
            return "afterany", point["train"], f"train {point['description']}"
    return None


def never_started(manifest: Mapping[str, Any], records: Mapping[str, slurm.JobRecord]) -> list[str]:
    """One line per job of the sweep that ended without ever running, naming what it waited for."""
    lines = []
    for what, _step, job_id in jobs_of(manifest):
        record = record_of(records, job_id)
        if record is None or not record.never_ran:
            continue
        line = f"{what} job {job_id}: {record.state} before it started"
        dependency = dependency_of(manifest, job_id)
        if dependency:
            kind, other, other_what = dependency
            line += chain.waited_for(kind, other, other_what, state_of(records, other))
        lines.append(line)
    return lines


def task_indices(bracket: str) -> set[int]:
    """The task indices of sacct's ``[0-3,5%2]`` (the part after ``<array>_``); empty when unparsable."""
    match = re.fullmatch(r"\[([0-9,-]+)(?:%\d+)?\]", bracket)
    indices: set[int] = set()
    for part in match.group(1).split(",") if match else []:
        first, _, last = part.partition("-")
        if first.isdigit() and (last or first).isdigit():
            indices.update(range(int(first), int(last or first) + 1))
    return indices


def record_of(records: Mapping[str, slurm.JobRecord], job_id: str) -> slurm.JobRecord | None:
    """sacct's record of ``job_id``. Array tasks that never started are one line, ``12_[0-1%2]``
    (pending, or cancelled by a failed dependency): that line's record, under the task's own id."""
    record = records.get(job_id)
    main, _, task = job_id.partition("_")
    if record is None and task.isdigit():
        for other_id, other in records.items():
            head, _, bracket = other_id.partition("_")
            if head == main and int(task) in task_indices(bracket):
                return dataclasses.replace(other, job_id=job_id)
    return record


def state_of(records: Mapping[str, slurm.JobRecord], job_id: str) -> str:
    record = record_of(records, job_id)
    return record.state if record else "UNKNOWN"


def table(manifest: Mapping[str, Any], records: Mapping[str, slurm.JobRecord]) -> str:
    """One row per run: configuration, train job and state, aggregation state, ms/iteration, bubble."""
    rows = [("configuration", "train", "state", "aggregate", "ms/iter", "bubble")]
    for point in manifest["points"]:
        summary = summary_of(point) or {}
        ms, bubble = summary.get("mean_iteration_time_ms"), summary.get("bubble_fraction")
        rows.append((point["description"], point["train"], state_of(records, point["train"]),
                     state_of(records, point["aggregate"]),
                     f"{ms:.1f}" if isinstance(ms, int | float) else "-",
                     f"{bubble:.4f}" if isinstance(bubble, int | float) else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    head = (f"sweep {manifest['name']}: {manifest['recipe']}, preprocess job {manifest['preprocess']} "
            f"{state_of(records, manifest['preprocess'])}")
    return "\n".join([head, *lines])


def verdict(manifest: Mapping[str, Any], records: Mapping[str, slurm.JobRecord]) -> str:
    states = [state_of(records, i) for i in job_ids(manifest)]
    if not all(s in slurm.TERMINAL_STATES for s in states):
        return "RUNNING"
    return "COMPLETED" if all(s == "COMPLETED" for s in states) else "FAILED"
