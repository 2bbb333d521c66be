"""trainer/checkpoint/watchdog.py on its own, in real processes (no torch): past the deadline the
process reports rank, action, iteration, folder and phase on stderr, kills its child processes and
exits 1; a block that finishes in time leaves the process to exit normally; bad settings are named.
tests/dist/test_checkpoint_deadline.py runs it inside real saves."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from trainer.checkpoint.watchdog import (
    DEFAULT_TIMEOUT_S,
    STALL_ENV,
    TIMEOUT_ENV,
    TimeoutSettingError,
    checkpoint_timeout_s,
)

REPO = Path(__file__).resolve().parents[2]
# One "save": a child process (as megatron-core's writer starts), then one phase under the deadline.
SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from trainer.checkpoint.watchdog import Watchdog

    child = subprocess.Popen(["sleep", "120"])
    print("child", child.pid, flush=True)
    with Watchdog("save", 3, Path("/ckpt/iter_0000007.tmp"), 7, timeout_s=float(sys.argv[1])) as watchdog:
        watchdog.enter("writing shards", "the test's stand-in")
        time.sleep(float(sys.argv[2]))
    child.kill()
    child.wait()
    print("saved", flush=True)
""")


def _run(timeout_s: float, work_s: float, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess,
                                                                                      float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(timeout_s), str(work_s)], cwd=REPO, text=True,
                          capture_output=True, timeout=60, env={**_base_env(), **(env or {})})
    return done, time.monotonic() - started


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (STALL_ENV, TIMEOUT_ENV)}


def _child_pid(stdout: str) -> int:
    return int(next(line.split()[1] for line in stdout.splitlines() if line.startswith("child ")))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_past_the_deadline_the_rank_reports_the_phase_kills_its_children_and_exits_1() -> None:
    done, seconds = _run(timeout_s=3.0, work_s=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert seconds < 30
    assert ("checkpoint save timed out on rank 3: the save of iteration 7 (/ckpt/iter_0000007.tmp) did not "
            "finish within 3 s (MDPP_CHECKPOINT_TIMEOUT_S); rank 3 was waiting in phase 'writing shards' "
            "(the test's stand-in)") in done.stderr
    assert "most recent call first" in done.stderr  # every thread's stack, for where it hung
    assert "saved" not in done.stdout
    assert _gone(_child_pid(done.stdout))


def test_the_test_hook_stalls_the_named_phase_until_the_deadline() -> None:
    done, _ = _run(timeout_s=3.0, work_s=0, env={STALL_ENV: "3:save:7:writing shards"})
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"{STALL_ENV}: stalling in phase 'writing shards' of the save of iteration 7" in done.stderr
    assert "rank 3 was waiting in phase 'writing shards'" in done.stderr
    assert _gone(_child_pid(done.stdout))
    other_rank, _ = _run(timeout_s=30.0, work_s=0, env={STALL_ENV: "2:save:7:writing shards"})
    assert other_rank.returncode == 0 and "saved" in other_rank.stdout, other_rank.stderr[-3000:]


def test_a_save_within_the_deadline_exits_normally_and_at_once() -> None:
    done, seconds = _run(timeout_s=600.0, work_s=0)
    assert done.returncode == 0 and "saved" in done.stdout, done.stderr[-3000:]
    assert "timed out" not in done.stderr
    assert seconds < 30  # the watchdog thread does not hold the exit for its 600 s


def test_timeout_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert checkpoint_timeout_s() == DEFAULT_TIMEOUT_S
    assert checkpoint_timeout_s(12.5) == 12.5
    monkeypatch.setenv(TIMEOUT_ENV, "90")
    assert checkpoint_timeout_s() == 90.0
    assert checkpoint_timeout_s(5) == 5  # the caller's argument wins
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(TimeoutSettingError, match=TIMEOUT_ENV):
            checkpoint_timeout_s()
    with pytest.raises(TimeoutSettingError, match="timeout_s"):
        checkpoint_timeout_s(0)
