"""The tests' way to start N ranks the way torchrun does: trainer/launch/local_ranks.py (the one launcher)
with the tests' defaults — the repository as working folder, OMP_NUM_THREADS=1 (2-core CI), output
kept in a temporary folder until the ranks are waited for, and no grace period after a failure (a
test may want a failing rank's peers to report for themselves)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainer.launch import local_ranks as launcher
from trainer.launch.ports import free_port

__all__ = ["REPO", "RankResult", "Ranks", "check_ok", "free_port", "launch", "start"]

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


@dataclass
class Ranks:
    """Running ranks; :meth:`wait` always returns (killing stragglers past the deadline)."""

    running: launcher.Ranks
    folder: Path

    @property
    def procs(self) -> list:
        return self.running.procs

    def output(self, rank: int) -> str:
        return self.running.output(rank)

    def wait(self, timeout_s: float) -> list[RankResult]:
        self.running.wait(timeout_s)
        results = [RankResult(rank, proc.returncode, self.running.output(rank))
                   for rank, proc in enumerate(self.running.procs)]
        shutil.rmtree(self.folder, ignore_errors=True)
        return results


def start(module_args: list[str], world_size: int, local_world_size: int | None = None,
          extra_env: dict[str, str] | None = None) -> Ranks:
    """Start ``python -m <module_args>`` on ``world_size`` ranks (OMP_NUM_THREADS=1: 2-core CI)."""
    folder = Path(tempfile.mkdtemp(prefix="mdpp-test-"))
    running = launcher.start_ranks(module_args, world_size, folder, run_id="t", cwd=REPO,
                                   env={"OMP_NUM_THREADS": "1", **(extra_env or {})},
                                   local_world_size=local_world_size)
    return Ranks(running, folder)


def launch(module_args: list[str], world_size: int, timeout_s: float = 240.0,
           local_world_size: int | None = None, extra_env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``python -m <module_args>`` on ``world_size`` ranks; kill everything past ``timeout_s``."""
    return start(module_args, world_size, local_world_size, extra_env).wait(timeout_s)


def check_ok(results: list[RankResult]) -> None:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        detail = "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-4000:]}" for r in bad)
        raise AssertionError(f"{len(bad)} rank(s) failed:\n{detail}")
