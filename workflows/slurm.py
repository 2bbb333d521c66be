"""Thin, typed wrappers over the Slurm commands: sbatch, sacct, scancel, scontrol, srun.

The one way this project runs a Slurm command (workflows/, and the slurm test tier): every call
has a timeout and raises :class:`SlurmError` with the command and Slurm's own message, so a CLI
can print one line instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 30.0  # slurmctld answers in milliseconds; 30 s means it is down or wedged
# States after which a job will not run again (REQUEUED and PENDING/RUNNING are not among them).
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE",
})
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Elapsed", "NodeList", "Start", "End")
# Every state, for sacct --state: with a time window and no --state, sacct leaves out jobs that never
# became eligible, e.g. a chain's training job cancelled while pending because preprocessing failed.
SACCT_ALL_STATES = "PD,R,RQ,S,RS,CD,CA,F,TO,NF,OOM,PR,BF,DL"


class SlurmError(RuntimeError):
    """A Slurm command failed or is missing; the message names the command and Slurm's reply."""


@dataclass(frozen=True)
class JobRecord:
    """One job as sacct reports it (the allocation line, not its steps)."""

    job_id: str
    """Numeric job id."""
    name: str
    """Job name (the chain's jobs are named mdpp-<run>-<step>)."""
    state: str
    """First word of sacct's State, e.g. COMPLETED; "CANCELLED by 0" becomes CANCELLED."""
    exit_code: str
    """ExitCode as return:signal, e.g. 0:0 or 2:0."""
    elapsed: str
    """Run time so far, HH:MM:SS."""
    nodes: str
    """NodeList (None assigned while pending)."""

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def never_ran(self) -> bool:
        """Ended without ever being given nodes: cancelled while pending (by hand, or by
        --kill-on-invalid-dep when its dependency can no longer be met)."""
        return self.finished and self.nodes in ("None assigned", "")


def require(command: str) -> str:
    """Path of a Slurm command, or SlurmError telling how to get one on PATH."""
    path = shutil.which(command)
    if path is None:
        raise SlurmError(
            f"{command} not found on PATH: run on a Slurm login node, or `source .cluster/env` "
            "after `scripts/cluster.sh up` for the local cluster"
        )
    return path


def call(args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = COMMAND_TIMEOUT_S,
         cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command and return it finished, whatever its exit status (some commands, e.g.
    `scontrol show hostnames`, report on stderr with status 0); SlurmError when it is not on PATH,
    when SLURM_CONF names no file, or when it gives no answer within ``timeout`` seconds."""
    conf = (os.environ if env is None else env).get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # the command would retry for a minute before failing
        raise SlurmError(f"SLURM_CONF={conf} does not exist")
    argv = [require(args[0]), *args[1:]]
    try:
        return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{args[0]} did not answer within {timeout:.0f} s: {' '.join(args)}") from exc


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    """The line that says why a command failed: its last on stderr, else on stdout."""
    message = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return message[-1] if message else "no output"


def run(args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = COMMAND_TIMEOUT_S,
        cwd: str | None = None) -> str:
    """Run a Slurm command, return its stdout; SlurmError with its stderr when it fails."""
    done = call(args, env, timeout, cwd)
    if done.returncode != 0:
        raise SlurmError(f"{args[0]} failed ({done.returncode}): {last_line(done)}")
    return done.stdout


def sbatch(script: str, options: Sequence[str], env: Mapping[str, str]) -> str:
    """Submit ``script`` with ``options``; the new job's id."""
    out = run(["sbatch", "--parsable", *options, script], env=env).strip()
    job_id = out.split(";")[0]  # --parsable prints "id" or "id;cluster"
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed {out!r} instead of a job id")
    log.info("submitted %s as job %s", script, job_id)
    return job_id


def scancel(job_ids: Sequence[str]) -> None:
    if job_ids:
        run(["scancel", *job_ids])


def sacct_command(job_ids: Sequence[str]) -> list[str]:
    """The sacct invocation a user can paste to watch the jobs (allocations only, wide names)."""
    return ["sacct", "-X", "-j", ",".join(job_ids), "--format=JobID,JobName%40,State,ExitCode,Elapsed,NodeList"]


def parse_sacct(text: str) -> list[JobRecord]:
    """Records from ``sacct --parsable2 --noheader --format=SACCT_FIELDS`` output."""
    records = []
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) != len(SACCT_FIELDS):
            continue  # sacct prints warnings on stdout in some versions; they are not records
        job_id, name, state, exit_code, elapsed, nodes = fields[:6]
        records.append(JobRecord(job_id, name, state.split()[0] if state else "UNKNOWN", exit_code, elapsed, nodes))
    return records


def query(job_ids: Sequence[str] = (), names: Sequence[str] = ()) -> list[JobRecord]:
    """sacct's current view of jobs given by id or by exact name (the latest run of a requeued job)."""
    args = ["sacct", "-X", "--parsable2", "--noheader", f"--format={','.join(SACCT_FIELDS)}"]
    if job_ids:
        args += ["-j", ",".join(job_ids)]
    if names:
        # Without a start time sacct only looks at today's jobs; a chain may have started earlier.
        args += ["--name", ",".join(names), "--starttime", "now-30days", "--endtime", "now",
                 "--state", SACCT_ALL_STATES]
    return parse_sacct(run(args))


@dataclass(frozen=True)
class Partition:
    """One partition as ``scontrol show partition --oneliner`` reports it."""

    name: str
    total_nodes: int
    """TotalNodes: nodes in the partition."""
    max_nodes: int | None
    """MaxNodes per job; None when UNLIMITED."""
    default: bool
    """Default=YES: jobs without --partition go here."""

    @property
    def node_limit(self) -> int:
        """Most nodes one job of this partition can ever get."""
        return self.total_nodes if self.max_nodes is None else min(self.total_nodes, self.max_nodes)


def parse_partitions(text: str) -> list[Partition]:
    """Partitions from ``scontrol show partition --oneliner`` (one ``Key=Value ...`` line each)."""
    found = []
    for line in text.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "PartitionName" not in fields:
            continue
        max_nodes = fields.get("MaxNodes", "UNLIMITED")
        found.append(Partition(
            name=fields["PartitionName"], total_nodes=int(fields.get("TotalNodes", "0")),
            max_nodes=None if max_nodes == "UNLIMITED" else int(max_nodes),
            default=fields.get("Default") == "YES",
        ))
    return found


def partitions() -> list[Partition]:
    """Every partition of the cluster."""
    return parse_partitions(run(["scontrol", "show", "partition", "--oneliner"]))


def array_tasks(array_id: str) -> set[int] | None:
    """Task indices slurmctld still holds for array ``array_id`` (pending ones included, from
    ``ArrayTaskId=0-1,3``); an empty set when it holds none ("Invalid job id"); None when unknown."""
    try:
        done = call(["scontrol", "show", "job", "--oneliner", array_id])
    except SlurmError:
        return None
    if done.returncode != 0:
        return set() if "Invalid job id" in done.stderr + done.stdout else None
    tasks: set[int] = set()
    for ids in re.findall(r"\bArrayTaskId=([0-9,-]+)", done.stdout):
        for part in ids.split(","):
            first, _, last = part.partition("-")
            tasks.update(range(int(first), int(last or first) + 1))
    return tasks
