"""Start N ranks the way torchrun does (RANK/WORLD_SIZE/LOCAL_*/MASTER_*), with a free port and a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


@dataclass
class Ranks:
    """Running ranks; :meth:`wait` always returns (killing stragglers past the deadline)."""

    procs: list[subprocess.Popen]
    logs: list = field(default_factory=list)

    def output(self, rank: int) -> str:
        return Path(self.logs[rank].name).read_text()

    def wait(self, timeout_s: float) -> list[RankResult]:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
        results = []
        for rank, (proc, log) in enumerate(zip(self.procs, self.logs, strict=True)):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            results.append(RankResult(rank, proc.returncode, log.read()))
            log.close()
            os.unlink(log.name)
        return results


def start(module_args: list[str], world_size: int, local_world_size: int | None = None,
          extra_env: dict[str, str] | None = None) -> Ranks:
    """Start ``python -m <module_args>`` on ``world_size`` ranks (OMP_NUM_THREADS=1: 2-core CI)."""
    port = free_port()
    ranks = Ranks(procs=[])
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(local_world_size or world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "TORCHELASTIC_RUN_ID": f"t{port}", **(extra_env or {})}
        log = tempfile.NamedTemporaryFile("w+", prefix=f"mdpp-test-{port}-{rank}-", suffix=".log", delete=False)
        ranks.logs.append(log)
        ranks.procs.append(subprocess.Popen([sys.executable, "-m", *module_args], cwd=REPO, env=env,
                                            stdout=log, stderr=subprocess.STDOUT))
    return ranks


def launch(module_args: list[str], world_size: int, timeout_s: float = 240.0,
           local_world_size: int | None = None, extra_env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``python -m <module_args>`` on ``world_size`` ranks; kill everything past ``timeout_s``."""
    return start(module_args, world_size, local_world_size, extra_env).wait(timeout_s)


def check_ok(results: list[RankResult]) -> None:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        detail = "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-4000:]}" for r in bad)
        raise AssertionError(f"{len(bad)} rank(s) failed:\n{detail}")
