"""A deadline on one checkpoint save or load: past it the rank says where it waited and exits 1.

Why: megatron-core's torch_dist writer forks worker processes and waits for them without a bound
(a worker that dies never marks its task done), and the save's collectives, megatron-core's and
this trainer's, wait for every rank; a rank that never reaches the save, or stalls inside it, left
every rank waiting until Slurm's time limit, and a job killed there can look like a finished one.

How: :class:`Watchdog` runs a daemon thread beside the saving (or loading) thread. The save marks
each phase it enters (:meth:`Watchdog.enter`); past the deadline the thread writes one line to
stderr naming the rank, the action, the iteration, the folder and the phase it was in, dumps every
thread's stack, kills this rank's child processes (megatron-core's writer workers and its Manager
would outlive it) and ends the process with ``os._exit(1)``: a thread blocked in a collective
cannot be unwound, and Python's exit handlers could wait on it themselves. The non-zero status
makes Slurm record the job FAILED (and ``--kill-on-bad-exit`` stops the ranks that wait elsewhere).
Every step after the report is bounded, so the watchdog itself cannot hang.

A save or load that raises instead (a collective's own timeout, in a rank waiting for a stalled
peer) logs the phase it was in before the error goes on. The deadline covers the whole save or load: ``timeout_s`` when the caller passes one, else
``$MDPP_CHECKPOINT_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`.

Test hook: ``$MDPP_TEST_CHECKPOINT_STALL=RANK:ACTION:ITERATION:PHASE`` (e.g. ``1:save:4:writing
shards``) makes global rank RANK sleep for ever when it enters that phase of that save or load, the
way a wedged writer or file system would hold it; tests/dist/test_checkpoint_deadline.py uses it.
Unset (always, outside tests) it costs one dictionary lookup per phase.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer.launch.exit_deadline import EXIT_CODE, ExitDeadline

log = logging.getLogger(__name__)

TIMEOUT_ENV = "MDPP_CHECKPOINT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
"""30 minutes for one save or load: far above what a healthy checkpoint takes on this project's
jobs, below Slurm time limits. Raise it through $MDPP_CHECKPOINT_TIMEOUT_S for very large models on
slow file systems."""
STALL_ENV = "MDPP_TEST_CHECKPOINT_STALL"
_REPORT_WAIT_S = 5.0  # how long flushing the log may take before the exit goes ahead without it


class TimeoutSettingError(ValueError):
    """$MDPP_CHECKPOINT_TIMEOUT_S holds no positive number of seconds."""


def checkpoint_timeout_s(explicit: float | None = None) -> float:
    """The deadline of one save or load: ``explicit``, else $MDPP_CHECKPOINT_TIMEOUT_S, else the default."""
    if explicit is not None:
        value, source = explicit, "timeout_s"
    else:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT_S
        try:
            value, source = float(text), f"${TIMEOUT_ENV}"
        except ValueError:
            raise TimeoutSettingError(f"${TIMEOUT_ENV}={text!r}: expected seconds (a positive number)") from None
    if not value > 0:
        raise TimeoutSettingError(f"{source}={value!r}: the checkpoint deadline must be > 0 seconds")
    return value


class Watchdog(ExitDeadline):
    """One save or load under a deadline (a context manager; see the module's docstring)."""

    def __init__(self, action: str, rank: int, folder: Path, iteration: int | None,
                 timeout_s: float | None = None) -> None:
        super().__init__(rank, checkpoint_timeout_s(timeout_s), f"checkpoint {action}",
                         thread_name=f"checkpoint-{action}-watchdog")
        self.action, self.folder, self.iteration = action, folder, iteration
        self.detail = ""

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._done.set()
        self._thread.join()  # returns at once: the event ends its wait
        if exc is not None:
            # E.g. a collective's own timeout (the process group's, max(600 s, --dpp-timeout) in
            # trainer.train) raised in a rank waiting for a stalled peer: say where it waited.
            log.error("checkpoint %s%s (%s) failed on rank %d in phase '%s' after %.1f s: %s",
                      self.action, self._of_iteration(), self.folder, self.rank, self.phase,
                      time.monotonic() - self._started, type(exc).__name__)

    def _of_iteration(self) -> str:
        return "" if self.iteration is None else f" of iteration {self.iteration}"

    def enter(self, phase: str, detail: str = "") -> None:
        """This rank now works (or waits) in ``phase``; ``detail`` says on what, for the report."""
        super().enter(phase)
        self.detail = detail
        _stall_if_asked(self.rank, self.action, self.iteration, phase)

    def report(self) -> str:
        now = time.monotonic()
        detail = f" ({self.detail})" if self.detail else ""
        return (f"checkpoint {self.action} timed out on rank {self.rank}: the {self.action}{self._of_iteration()} "
                f"({self.folder}) did not finish within {self.timeout_s:g} s ({TIMEOUT_ENV}); rank "
                f"{self.rank} was waiting in phase '{self.phase}'{detail} for {now - self._phase_started:.1f} s "
                f"of {now - self._started:.1f} s. No tracker is written for an unfinished save (a resume "
                f"takes the previous checkpoint). Exiting with status {EXIT_CODE}.")

    def after_report(self, message: str) -> None:
        _bounded(lambda: (log.error("%s", message), sys.stdout.flush(), sys.stderr.flush()), _REPORT_WAIT_S)
        _bounded(_kill_child_processes, _REPORT_WAIT_S)


def _bounded(work: Callable[[], object], timeout_s: float) -> None:
    """Run ``work`` in a daemon thread for at most ``timeout_s`` (a lock held by the stuck thread
    must not stop the exit); errors are ignored: the exit goes ahead either way."""
    def run() -> None:
        with contextlib.suppress(Exception):
            work()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)


def _kill_child_processes() -> None:
    """SIGKILL what this rank started (megatron-core's forked writers, its spawned Manager), and wait
    (at most 5 s) until they are gone."""
    try:
        import psutil  # megatron-core's writer needs it: present wherever --save works
    except ImportError:
        import multiprocessing

        children = multiprocessing.active_children()
        for child in children:
            child.kill()
        for child in children:
            child.join(5.0)
        return
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    # SIGKILL is delivered when the child is next scheduled: on a loaded host this rank could otherwise
    # exit while its writers still run. Bounded: a child stuck in the kernel (D state) is not waited out.
    with contextlib.suppress(psutil.Error):
        psutil.wait_procs(children, timeout=5.0)


def _stall_if_asked(rank: int, action: str, iteration: int | None, phase: str) -> None:
    spec = os.environ.get(STALL_ENV)
    if not spec or spec.split(":", 3) != [str(rank), action, str(iteration), phase]:
        return
    os.write(2, f"[rank {rank}] {STALL_ENV}: stalling in phase '{phase}' of the {action} of iteration "
                f"{iteration}\n".encode())
    while True:  # until the watchdog ends the process
        time.sleep(60)
