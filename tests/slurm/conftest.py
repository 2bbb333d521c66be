"""The slurm tier: every test here runs against the project's real local cluster (scripts/cluster.sh).

The session brings the cluster up once (a no-op when it already runs), exports its SLURM_CONF so
that sbatch, srun, sacct and the code under test talk to it, and marks every test here `slurm`.
The session that started the cluster stops it at the end, unless another test session is still
using it (a shared lock on .cluster/pytest.lock says so): a developer's running cluster is left
alone, and a CI run leaves no daemon behind.

Tests submit through the `slurm` fixture:

    job = slurm.run(["--nodes=2", "--wrap", "srun hostname"], timeout=60)
    assert job.state == "COMPLETED", job.describe()
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from workflows import slurm as slurm_commands  # the `slurm` name is the fixture below
from workflows.nodes import expand_builtin

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "cluster.sh"
CLUSTER_DIR = Path(os.environ.get("MDPP_CLUSTER_DIR", REPO / ".cluster")).resolve()
UP_TIMEOUT_S = 180  # a first start initialises MariaDB: ~10 s here, more on a busy CI runner


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.slurm)


def run_command(args: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run scripts/cluster.sh with a timeout; a failure names the command (Slurm's own commands go
    through workflows.slurm, as everywhere else)."""
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as error:
        said = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else (error.stderr or "")
        raise AssertionError(f"`{' '.join(args)}` did not finish within {timeout:.0f} s; it said:\n{said}") from error
    return proc


def cluster_is_up(env: dict[str, str] | None = None) -> bool:
    return run_command([str(CLUSTER_SCRIPT), "status"], timeout=30, env=env).returncode == 0


def read_cluster_env(cluster_dir: Path) -> dict[str, str]:
    """The variables that `source <cluster_dir>/env` exports."""
    env = {}
    for line in (cluster_dir / "env").read_text().splitlines():
        if line.startswith("export SLURM_CONF="):
            env["SLURM_CONF"] = line.split("=", 1)[1]
    assert "SLURM_CONF" in env, f"{cluster_dir / 'env'} exports no SLURM_CONF"
    return env


@dataclass(frozen=True)
class JobResult:
    """A finished job as sacct records it."""

    job_id: str
    state: str
    exit_code: str
    nodes: str
    steps: dict[str, tuple[str, str]]  # step id (e.g. "123.0", "123.batch") -> (state, nodes)
    output: str  # the job's stdout file, when it was written under the test's folder

    def describe(self) -> str:
        return (f"job {self.job_id}: {self.state} exit {self.exit_code} on {self.nodes}; "
                f"steps {self.steps}; output:\n{self.output}")


class Slurm:
    """Submit jobs to the local cluster and wait for them, every wait bounded."""

    def __init__(self, workdir: Path):
        self.workdir = workdir

    def sbatch(self, args: Sequence[str]) -> str:
        out = slurm_commands.run(["sbatch", "--parsable", f"--chdir={self.workdir}",
                                  f"--output={self.workdir}/slurm-%j.out", *args])
        return out.strip().split(";")[0]

    def sacct(self, job_id: str) -> dict[str, tuple[str, str, str, int]]:
        """Job and step records: id -> (state, exit code, node list, node count)."""
        out = slurm_commands.call(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State,ExitCode,NodeList,NNodes"]).stdout
        rows = {}
        for line in out.splitlines():
            job, state, exit_code, nodes, count = line.split("|")
            rows[job] = (state.split()[0] if state else "", exit_code, nodes, int(count or 0))
        return rows

    @staticmethod
    def _settled(row: tuple[str, str, str, int]) -> bool:
        """Terminal, and the node list complete: for a few seconds after a multi-node job ends,
        slurmdbd's record names only the first node (NNodes is already right)."""
        state, _, nodes, count = row
        if state not in slurm_commands.TERMINAL_STATES:
            return False
        return nodes == "None assigned" or len(expand_builtin(nodes)) == count

    def wait(self, job_id: str, timeout: float = 60) -> JobResult:
        """Poll sacct until the job's record is final; fail naming the job and its last state."""
        deadline = time.monotonic() + timeout
        rows: dict[str, tuple[str, str, str, int]] = {}
        while time.monotonic() < deadline:
            rows = self.sacct(job_id)
            if job_id in rows and self._settled(rows[job_id]):
                state, exit_code, nodes, _ = rows[job_id]
                out = self.workdir / f"slurm-{job_id}.out"
                return JobResult(
                    job_id, state, exit_code, nodes,
                    {k: (v[0], v[2]) for k, v in rows.items() if k != job_id},
                    out.read_text() if out.exists() else "",
                )
            time.sleep(0.5)
        slurm_commands.call(["scancel", job_id])
        raise AssertionError(f"job {job_id} did not finish within {timeout:.0f} s "
                             f"(last sacct: {rows.get(job_id, 'no record')}); cancelled it")

    def run(self, args: Sequence[str], timeout: float = 60) -> JobResult:
        return self.wait(self.sbatch(args), timeout)


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster() -> Iterator[dict[str, str]]:
    """Bring the local cluster up for the session and export its SLURM_CONF; yields that env."""
    CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    lock = open(CLUSTER_DIR / "pytest.lock", "w")  # noqa: SIM115 - held for the whole session
    fcntl.flock(lock, fcntl.LOCK_SH)
    started_here = not cluster_is_up()
    t0 = time.monotonic()
    proc = run_command([str(CLUSTER_SCRIPT), "up"], timeout=UP_TIMEOUT_S)
    assert proc.returncode == 0, f"scripts/cluster.sh up failed:\n{proc.stderr}"
    up_seconds = time.monotonic() - t0
    env = read_cluster_env(CLUSTER_DIR)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    if started_here:
        print(f"\nlocal Slurm cluster started in {up_seconds:.1f} s")
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else in a session?
            alone = True
        except BlockingIOError:
            alone = False
        if started_here and alone:
            run_command([str(CLUSTER_SCRIPT), "down"], timeout=120)
        lock.close()


@pytest.fixture
def slurm(tmp_path: Path) -> Slurm:
    """Submit/wait helper whose job output lands in the test's own folder."""
    return Slurm(tmp_path)
