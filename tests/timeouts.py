"""Test deadlines that stretch with the machine's load: one rule for every wait a test makes on work
that competes for the CPUs (ranks, Slurm jobs, a chain's steps).

A budget is written as what the wait needs on an idle machine (CI's 2 cores, nothing else running).
While the wait lasts, :class:`Budget` reads the load average and stretches the budget by
``load / cores`` (never below 1, at most MAX_STRETCH): two full test runs at once on 2 cores put the
load near 7, and the same work then takes about 3.5 times as long. The stretch only grows during a
wait (a wait that began under load keeps its room when the load drops at the end).

Slow work that never ends still fails, and says so: at most MAX_STRETCH times the idle budget, with a
message naming what was waited for, the state seen last, and the load that set the deadline.
pytest-timeout's bounds around such waits are written as :func:`ceiling` of the idle budget, so the
wait's own message comes first.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

MAX_STRETCH = 4.0
"""The most a budget stretches: load 8 on 2 cores. Beyond that a machine is too busy to test on."""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def stretch() -> float:
    """How much longer work takes now than on an idle machine: 1-minute load / cores, in [1, MAX_STRETCH]."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - no load average on this system
        return 1.0
    return min(max(load / cores(), 1.0), MAX_STRETCH)


def ceiling(idle_s: float) -> float:
    """The longest a wait with idle budget ``idle_s`` can take: for pytest-timeout marks around it."""
    return idle_s * MAX_STRETCH


class Budget:
    """``idle_s`` seconds of waiting at load <= cores, stretched by the load seen while waiting."""

    def __init__(self, idle_s: float, what: str):
        self.idle_s, self.what = idle_s, what
        self.started = time.monotonic()
        self.factor = stretch()

    @property
    def allowed_s(self) -> float:
        return self.idle_s * self.factor

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def remaining_s(self) -> float:
        return max(self.allowed_s - self.elapsed_s(), 0.0)

    def expired(self) -> bool:
        if self.elapsed_s() < self.allowed_s:
            return False
        self.factor = max(self.factor, stretch())  # the load may have risen since the last look
        return self.elapsed_s() >= self.allowed_s

    def describe(self) -> str:
        return (f"{self.what}: not done after {self.elapsed_s():.0f} s (budget {self.idle_s:.0f} s idle, "
                f"x{self.factor:.1f} for load {_load()} on {cores()} cores)")


def wait_until(done: Callable[[], bool], idle_s: float, what: str, state: Callable[[], str] | None = None,
               poll_s: float = 0.5) -> float:
    """Poll ``done`` until true within a load-stretched budget; the seconds it took. AssertionError
    naming ``what``, the budget, the load and ``state()`` (the state seen last) otherwise."""
    budget = Budget(idle_s, what)
    while not done():
        if budget.expired():
            raise AssertionError(budget.describe() + (f"; last seen: {state()}" if state is not None else ""))
        time.sleep(poll_s)
    return budget.elapsed_s()


def communicate_within(proc: subprocess.Popen, budget: Budget | float, what: str = "",
                       state: Callable[[], str] | None = None) -> tuple[str, str]:
    """``proc.communicate()`` within a load-stretched budget (a Budget already running, or an idle
    budget in seconds for ``what``), its pipes drained all along; past it the process is killed and
    AssertionError names what was waited for, the budget, the load, ``state()`` and the process's
    output so far."""
    budget = budget if isinstance(budget, Budget) else Budget(budget, what)
    while True:
        try:
            return proc.communicate(timeout=min(max(budget.remaining_s(), 1.0), 10.0))
        except subprocess.TimeoutExpired:
            if not budget.expired():
                continue
        seen = f"; last seen: {state()}" if state is not None else ""
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{budget.describe()}{seen}\nstdout:\n{out}\nstderr:\n{err}")


def _load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "unknown"
