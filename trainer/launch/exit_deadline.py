"""A deadline on one wait that cannot be interrupted: destroying the process groups here, a checkpoint
save or load in trainer/checkpoint/watchdog.py (its :class:`Watchdog` is this with its own report).

Why: ``destroy_process_group`` finalises and destroys each NCCL communicator without a deadline, and
``ncclCommDestroy`` waits for the communicator's in-flight work and for every CUDA graph that captured
one of its collectives; a rank left waiting there holds its Slurm job until the time limit. Python
cannot unwind a thread blocked in C++, so past the deadline a daemon thread writes one line naming
the rank, the phase it waits in and for how long, dumps every thread's stack and ends the process
with ``os._exit(1)`` (trainer.train's "failure"; the run's results were written before tear-down).

The thread needs the GIL; should the blocking call hold it, ``trainer.train.main``'s
``faulthandler.dump_traceback_later`` over the whole tear-down (a C thread) still dumps and exits,
later and without the named line.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import threading
import time

EXIT_CODE = 1


class ExitDeadline:
    """``with ExitDeadline(rank, timeout_s, what):`` -- :meth:`enter` names each phase; past
    ``timeout_s`` (whole block) the process reports and exits. ``exit`` is swappable for tests."""

    def __init__(self, rank: int, timeout_s: float, what: str, exit=os._exit, stderr_fd: int = 2,
                 thread_name: str = "exit-deadline") -> None:
        self.rank, self.timeout_s, self.what = rank, timeout_s, what
        self.phase = "starting"
        self._exit, self._fd = exit, stderr_fd
        self._started = self._phase_started = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=thread_name, daemon=True)

    def __enter__(self) -> ExitDeadline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5.0)  # returns at once unless the report is being written

    def enter(self, phase: str) -> None:
        self.phase, self._phase_started = phase, time.monotonic()

    def report(self) -> str:
        now = time.monotonic()
        return (f"rank {self.rank}: {self.what} did not finish within {self.timeout_s:g} s; it has waited "
                f"{now - self._phase_started:.1f} s in '{self.phase}'. Exiting with status {EXIT_CODE} "
                "(stacks below)")

    def after_report(self, message: str) -> None:
        """What to do between the report and the exit (nothing here; trainer/checkpoint/watchdog.py
        logs and kills the rank's child processes). Must not block: the exit waits for it."""

    def _watch(self) -> None:
        if self._done.wait(self.timeout_s):
            return
        message = self.report()
        with contextlib.suppress(OSError):
            os.write(self._fd, f"\n[rank {self.rank}] ERROR {message}\n".encode())  # needs no lock
            faulthandler.dump_traceback(file=self._fd, all_threads=True)
        self.after_report(message)
        self._exit(EXIT_CODE)
