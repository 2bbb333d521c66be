"""The local cluster itself: two idle nodes on their own addresses, jobs across both, accounting,
an idempotent `up`, a `down` that leaves no process, and start-up failures that name the daemon."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import CLUSTER_DIR, CLUSTER_SCRIPT, read_cluster_env, run_command
from trainer.launch.ports import bindable
from workflows import slurm as slurm_commands


def _pids_of_cluster(conf: str) -> list[int]:
    """Processes that carry this cluster's SLURM_CONF (daemons, step daemons, job steps)."""
    pids = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
            continue
        try:
            environ = (proc_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_CONF={conf}".encode() in environ:
            pids.append(int(proc_dir.name))
    return pids


@pytest.mark.timeout(60)
def test_both_nodes_up_on_distinct_loopback_addresses():
    rows = slurm_commands.call(["sinfo", "-h", "-N", "-o", "%N|%T|%c|%P"], timeout=30).stdout.split()
    nodes = {row.split("|")[0]: row.split("|")[1:] for row in rows}
    assert sorted(nodes) == ["node1", "node2"], rows
    for state, cpus, partition in nodes.values():
        # idle unless jobs run (or a job just ended and its epilog runs: completing); never down,
        # drained or not responding ('*')
        assert state in {"idle", "mixed", "allocated", "completing"}, rows
        assert cpus == "8" and partition == "debug*", rows
    addresses = {}
    for node in ("node1", "node2"):
        shown = slurm_commands.call(["scontrol", "show", "node", "-o", node], timeout=30).stdout
        addresses[node] = re.search(r"NodeAddr=(\S+)", shown).group(1)
    assert addresses == {"node1": "127.0.0.11", "node2": "127.0.0.12"}


@pytest.mark.timeout(90)
def test_srun_runs_one_task_on_each_node():
    # Both slurmds run on this one host, so `hostname` prints the host's name twice; the node a
    # task landed on is SLURMD_NODENAME (docs/cluster.md).
    proc = slurm_commands.call(["srun", "--nodes=2", "--ntasks=2", "-l", "printenv", "SLURMD_NODENAME"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["0:", "1:", "node1", "node2"]


@pytest.mark.timeout(120)
def test_sacct_records_a_finished_job_on_both_nodes(slurm):
    job = slurm.run(["--nodes=2", "--job-name=two-nodes", "--wrap", "srun printenv SLURMD_NODENAME"])
    assert job.state == "COMPLETED" and job.exit_code == "0:0", job.describe()
    assert job.nodes == "node[1-2]", job.describe()
    assert job.steps[f"{job.job_id}.0"] == ("COMPLETED", "node[1-2]"), job.describe()
    assert sorted(job.output.split()) == ["node1", "node2"], job.describe()


@pytest.mark.timeout(120)
def test_a_failing_job_is_recorded_as_failed(slurm):
    job = slurm.run(["--nodes=1", "--wrap", "exit 3"])
    assert (job.state, job.exit_code) == ("FAILED", "3:0"), job.describe()


@pytest.mark.timeout(60)
def test_up_is_idempotent():
    pid_files = sorted((CLUSTER_DIR / "run").glob("*.pid"))
    before = {p.name: p.read_text() for p in pid_files}
    t0 = time.monotonic()
    proc = run_command([str(CLUSTER_SCRIPT), "up"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 15
    assert proc.stderr.count("already running") == 6, proc.stderr
    assert {p.name: p.read_text() for p in sorted((CLUSTER_DIR / "run").glob("*.pid"))} == before


@pytest.fixture
def spare_cluster_dir():
    """A second, throw-away cluster folder (own ports, derived from its path); always torn down."""
    folder = Path(tempfile.mkdtemp(prefix="mdpp-cl-"))  # short: unix socket paths are limited
    env = {**os.environ, "MDPP_CLUSTER_DIR": str(folder)}
    yield folder, env
    run_command([str(CLUSTER_SCRIPT), "purge"], timeout=120, env=env)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _kill_wait(conf: str) -> int:
    found = re.findall(r"^KillWait=(\d+)", Path(conf).read_text(), flags=re.M)
    assert found, f"no KillWait in {conf}"
    return int(found[-1])


@pytest.mark.timeout(420)
def test_up_then_down_leaves_no_process(spare_cluster_dir):
    folder, env = spare_cluster_dir
    t0 = time.monotonic()
    up = run_command([str(CLUSTER_SCRIPT), "up"], timeout=120, env=env)
    start_seconds = time.monotonic() - t0
    assert up.returncode == 0, up.stderr
    assert start_seconds < 60, f"cold start took {start_seconds:.0f} s"
    conf = read_cluster_env(folder)["SLURM_CONF"]
    job_env = {**env, "SLURM_CONF": conf}
    # A job still running at `down` must be cancelled, its step daemons included.
    job = slurm_commands.call(["sbatch", "--parsable", "--nodes=2", f"--chdir={folder}", "--output=/dev/null",
                              "--wrap", "srun sleep 300"], timeout=30, env=job_env)
    assert job.returncode == 0, job.stderr
    deadline = time.monotonic() + 30
    while slurm_commands.call(["squeue", "-h", "-j", job.stdout.strip(), "-o", "%T"], timeout=30,
                              env=job_env).stdout.strip() != "RUNNING":
        assert time.monotonic() < deadline, "the sleep job never started"
        time.sleep(0.3)
    # ...once its task runs: a cancel that reaches a step still being launched leaves its task to
    # Slurm's SIGKILL, KillWait later (seen on a loaded CI host), which tests Slurm, not `down`.
    deadline = time.monotonic() + 60
    while not any(_comm(pid) == "sleep" for pid in _pids_of_cluster(conf)):
        assert time.monotonic() < deadline, "the job's task (sleep) never started"
        time.sleep(0.3)
    # `down` waits up to KillWait + 15 s for jobs to end, then up to 15 s for each of two groups of daemons.
    down = run_command([str(CLUSTER_SCRIPT), "down"], timeout=_kill_wait(conf) + 15 + 30 + 30, env=env)
    assert down.returncode == 0, down.stderr
    leftover = _pids_of_cluster(conf)
    assert not leftover, f"processes left after down: {leftover}"
    assert run_command([str(CLUSTER_SCRIPT), "status"], timeout=30, env=env).returncode != 0


@pytest.mark.timeout(120)
def test_up_names_the_daemon_that_cannot_start(spare_cluster_dir):
    folder, env = spare_cluster_dir
    with socket.socket() as squatter:  # hold MariaDB's port before the cluster gets it
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        proc = run_command([str(CLUSTER_SCRIPT), "up"], timeout=60,
                           env={**env, "MDPP_CLUSTER_PORT_BASE": str(port)})
    assert proc.returncode != 0
    assert f"cluster: error: mariadb: port {port} on 127.0.0.1 is taken" in proc.stderr, proc.stderr


def _free_port_base() -> int:
    """A cluster port base whose five ports (MariaDB, slurmdbd, slurmctld, two slurmd) are free,
    below the kernel's ephemeral range (32768+): there any process's client socket can hold a port
    of the block at any moment (CI once saw slurmdbd, on base + 1, die so instead of slurmd-node2).
    The default bases (12000-19990, from the cluster folder's path) are below 20000."""
    for base in random.Random().sample(range(20000, 32000, 10), 200):
        if all(bindable("127.0.0.1", port) for port in range(base, base + 4)) and bindable("127.0.0.12", base + 4):
            return base
    raise AssertionError("no free block of five ports in 20000..31999")


@pytest.mark.timeout(120)
def test_up_names_the_daemon_that_died_and_shows_its_log(spare_cluster_dir):
    folder, env = spare_cluster_dir
    # Hold node2's port on node2's own address: the check on 127.0.0.1 passes, slurmd's bind fails.
    node2_port = _free_port_base() + 4
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.12", node2_port))
        squatter.listen()
        proc = run_command([str(CLUSTER_SCRIPT), "up"], timeout=100,
                           env={**env, "MDPP_CLUSTER_PORT_BASE": str(node2_port - 4)})
    assert proc.returncode != 0
    assert re.search(r"cluster: error: slurmd-node2 exited during start-up \(exit status \d+; logs above\)$",
                     proc.stderr.rstrip()), proc.stderr
    assert f"---- last lines of {folder}/log/slurmd-node2.log" in proc.stderr
    assert f"Unable to bind listen port ({node2_port})" in proc.stderr


def test_usage_error_names_the_commands():
    proc = subprocess.run([str(CLUSTER_SCRIPT), "sideways"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr and "up|down|status|purge" in proc.stderr
