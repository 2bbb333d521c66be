"""The tests' way to start N ranks the way torchrun does: trainer/launch/local_ranks.py (the one launcher)
with the tests' defaults — the repository as working folder, OMP_NUM_THREADS=1 (2-core CI), output
kept in a temporary folder until the ranks are waited for.

When a rank fails, its peers get PEER_REPORT_GRACE_S (stretched by the machine's load, tests/timeouts.py)
to end by themselves, then the launcher kills them, as torchrun and srun --kill-on-bad-exit end a job.
A peer's own bounded errors in the tests come well within it -- a link's wait (--dpp-timeout, 20-30 s
in the tests that fail a rank on purpose), a lost store or gloo peer (at once), the checkpoint
watchdog (seconds) -- so a test can still read a failing rank's peers reporting for themselves; what
it no longer does is sit out a wait that has no near bound (a rank at the rendezvous whose rank 0
died waits RENDEZVOUS_TIMEOUT_S, 300 s). A test that checks a peer's report of a longer wait passes
``failure_grace_s`` itself."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.timeouts import stretch
from trainer.launch import local_ranks as launcher
from trainer.launch.ports import free_port

__all__ = ["PEER_REPORT_GRACE_S", "REPO", "RankResult", "Ranks", "check_ok", "free_port", "launch", "start"]

REPO = Path(__file__).resolve().parents[2]
PEER_REPORT_GRACE_S = 45.0
"""After a rank fails, how long (idle machine; stretched by the load) its peers get to end by themselves."""


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

    def wait(self, timeout_s: float, failure_grace_s: float | None = None) -> list[RankResult]:
        """Wait for every rank until ``timeout_s`` or, once one has failed, ``failure_grace_s`` (default:
        PEER_REPORT_GRACE_S stretched by the load now) more; kill what is still running then."""
        grace = PEER_REPORT_GRACE_S * stretch() if failure_grace_s is None else failure_grace_s
        self.running.wait(timeout_s, grace)
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
           local_world_size: int | None = None, extra_env: dict[str, str] | None = None,
           failure_grace_s: float | None = None) -> list[RankResult]:
    """Run ``python -m <module_args>`` on ``world_size`` ranks; kill everything past ``timeout_s``, or
    ``failure_grace_s`` after a rank failed (Ranks.wait)."""
    return start(module_args, world_size, local_world_size, extra_env).wait(timeout_s, failure_grace_s)


def check_ok(results: list[RankResult]) -> None:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        detail = "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-4000:]}" for r in bad)
        raise AssertionError(f"{len(bad)} rank(s) failed:\n{detail}")
