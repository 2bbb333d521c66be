"""The sbatch parameters a user sets from the submit CLI, validated before anything is submitted.

    --time 04:00:00 --account proj --qos high --constraint a100 --exclusive --mem 0
    --cpus-per-task 8 --gpus-per-node 4 --sbatch-arg mail-type=END (repeatable pass-through)

:func:`SbatchParams.problems` names every bad value at once, so a user fixes them in one go instead
of discovering them one sbatch rejection (or one queue wait) at a time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (and "infinite"/"UNLIMITED").
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_MEM = re.compile(r"^\d+[KMGT]?$", re.IGNORECASE)
_WORD = re.compile(r"^[A-Za-z0-9_.,:@%&|!()\[\]*+=/-]+$")  # account/qos/constraint expressions, no spaces
_PASS_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
# Pass-through keys the driver sets itself: a second value would silently fight the chain's own.
RESERVED = frozenset({
    "job-name", "output", "error", "chdir", "dependency", "kill-on-invalid-dep", "nodes", "ntasks",
    "ntasks-per-node", "array", "signal", "requeue", "open-mode", "wrap",
})
GPU_ALLOCATION = {"exclusive": True, "wait-all-nodes": 1}  # what every GPU training job asks for


@dataclass(frozen=True)
class SbatchParams:
    """Common sbatch parameters of the chain's jobs; None/False leaves Slurm's (or the file's) default."""

    time: str | None = None
    """--time of the training job (preprocess/aggregate keep their own short limits)."""
    account: str | None = None
    """--account of every job."""
    qos: str | None = None
    """--qos of every job."""
    constraint: str | None = None
    """--constraint (node features) of the training job."""
    exclusive: bool = False
    """--exclusive for the training job (always on for GPU runs)."""
    mem: str | None = None
    """--mem per node of the training job, e.g. 0 (all), 64G."""
    cpus_per_task: int | None = None
    """--cpus-per-task of each training rank (default 1 on CPU)."""
    gpus_per_node: int = 0
    """--gpus-per-node of the training job; > 0 selects the recipe's GPU size."""
    extra: Mapping[str, str] = field(default_factory=dict)
    """Any other sbatch long option (without --), value "" for a flag; applied to every job."""

    def problems(self) -> list[str]:
        """Every bad value, each as 'flag value: why' (empty: all good)."""
        errors = []
        if self.time is not None and not (_TIME.match(self.time) or self.time.lower() in ("infinite", "unlimited")):
            errors.append(f"--time {self.time!r}: expected minutes, H:M:S or D-H:M:S")
        for flag, value in (("--account", self.account), ("--qos", self.qos), ("--constraint", self.constraint)):
            if value is not None and not _WORD.match(value):
                errors.append(f"{flag} {value!r}: expected one word (no spaces or quotes)")
        if self.mem is not None and not _MEM.match(self.mem):
            errors.append(f"--mem {self.mem!r}: expected a size such as 0, 64000, 64G")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            errors.append(f"--cpus-per-task {self.cpus_per_task}: must be >= 1")
        if self.gpus_per_node < 0:
            errors.append(f"--gpus-per-node {self.gpus_per_node}: must be >= 0")
        for key, value in self.extra.items():
            if not _PASS_KEY.match(key):
                errors.append(f"--sbatch-arg {key}={value}: {key!r} is not an sbatch long option name")
            elif key in RESERVED:
                errors.append(f"--sbatch-arg {key}: set by the driver itself (reserved: {', '.join(sorted(RESERVED))})")
            elif key.replace("-", "_") in {"time", "account", "qos", "constraint", "exclusive", "mem",
                                           "cpus_per_task", "gpus_per_node", "partition"}:
                errors.append(f"--sbatch-arg {key}: use --{key} instead")
            elif any(ch in value for ch in "\n\r\0"):
                errors.append(f"--sbatch-arg {key}: value must be one line")
        return errors

    def shared(self) -> dict[str, object]:
        """sbatch options (long name -> value, True for a flag) of every job of the chain."""
        options: dict[str, object] = {}
        if self.account:
            options["account"] = self.account
        if self.qos:
            options["qos"] = self.qos
        options.update({key: (value if value != "" else True) for key, value in self.extra.items()})
        return options

    def training(self) -> dict[str, object]:
        """sbatch options of the training job, on top of :meth:`shared` (GPU runs: whole nodes)."""
        options = self.shared()
        if self.time:
            options["time"] = self.time
        if self.constraint:
            options["constraint"] = self.constraint
        if self.mem is not None:
            options["mem"] = self.mem
        if self.gpus_per_node:
            options["gpus-per-node"] = self.gpus_per_node
            options.update(GPU_ALLOCATION)
        elif self.exclusive:
            options["exclusive"] = True
        return options


def as_flags(options: Mapping[str, object]) -> list[str]:
    """{'time': '1:00:00', 'exclusive': True} -> ['--time=1:00:00', '--exclusive'] (sbatch's syntax)."""
    return [f"--{key}" if value is True else f"--{key}={value}" for key, value in options.items()]


def parse_pass_through(text: str) -> tuple[str, str]:
    """argparse ``type`` for --sbatch-arg: 'mail-type=END' or a bare flag 'overcommit'; leading -- allowed."""
    key, _sep, value = text.removeprefix("--").partition("=")
    return key, value
