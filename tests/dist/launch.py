"""Start N ranks the way torchrun does (RANK/WORLD_SIZE/LOCAL_*/MASTER_*), with a free port and a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(module_args: list[str], world_size: int, timeout_s: float = 240.0,
           local_world_size: int | None = None, extra_env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``python -m <module_args>`` on ``world_size`` ranks; kill everything past ``timeout_s``."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(local_world_size or world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "TORCHELASTIC_RUN_ID": f"t{port}", **(extra_env or {})}
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"mdpp-test-{port}-{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", *module_args], cwd=REPO, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            break
    results = []
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        results.append(RankResult(rank, proc.returncode, log.read()))
        log.close()
        os.unlink(log.name)
    return results


def check_ok(results: list[RankResult]) -> None:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        detail = "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-4000:]}" for r in bad)
        raise AssertionError(f"{len(bad)} rank(s) failed:\n{detail}")
