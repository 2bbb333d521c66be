"""Catch USR1/TERM from the first moment of a training process, before torch is imported.

Slurm forwards its pre-timeout/preemption warning (USR1) and TERM to the ranks whenever it comes;
importing torch and megatron takes seconds on a busy node, and a signal in that window would kill
the rank with the default action instead of asking for a checkpoint. trainer/train.py calls
:func:`install_for_main` before importing torch; the handlers only note the signal, and its
PreemptionFlag takes the note over once installed. Imported by tests or tools, nothing is installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
received: list[str] = []
"""Names of the signals noted so far, oldest first."""


def _note(signum: int, frame: Any) -> None:
    received.append(signal.Signals(signum).name)


READY_DIR_ENV = "MDPP_READY_DIR"
"""Set by the training batch script: each rank leaves a file there once its handlers are in place,
and the script forwards USR1 to the ranks only when all of them have (before that, the default
action of USR1 would kill a rank that is still starting Python)."""


def install_for_main(module_name: str) -> None:
    """Install the noting handlers when ``module_name`` is ``"__main__"`` (``python -m trainer.train``),
    then report this rank ready for signals in $MDPP_READY_DIR when that is set."""
    if module_name == "__main__":
        for sig in SIGNALS:
            signal.signal(sig, _note)
        ready_dir = os.environ.get(READY_DIR_ENV)
        if ready_dir:
            rank = os.environ.get("SLURM_PROCID") or os.environ.get("RANK") or "0"
            try:
                with open(os.path.join(ready_dir, f"rank{rank}"), "w"):
                    pass
            except OSError as exc:  # the script then keeps the signal until srun ends: say why
                print(f"early_signals: cannot mark rank {rank} ready in {ready_dir}: {exc}", file=sys.stderr)


@contextlib.contextmanager
def kept_from_child_processes() -> Iterator[None]:
    """Start the block's child processes (megatron-core's checkpoint writer: forked workers, and in
    the versions that keep one a spawned multiprocessing Manager) immune to the ranks' signals and
    bound to this process's life.

    Immune: USR1/TERM are blocked in this thread while the block runs, so that processes started from
    it inherit them blocked. Slurm delivers a step's signals to every process of the step, children
    included, and a child starts with the default actions, which kill it: the checkpoint that the
    signal asked for then died in megatron-core's writer (BrokenPipeError/EOFError from its Manager).
    A child inherits the signal mask of the thread that starts it, so it stays immune after the
    block. Python's resource tracker is started here first, because starting it UNBLOCKS SIGINT and
    SIGTERM in the calling thread (multiprocessing.resource_tracker.ensure_running, 3.8-3.13): were it
    started by the first spawn inside the block, everything spawned after it would die of TERM.

    Bound: a child forked inside the block dies with this process (PR_SET_PDEATHSIG, Linux). Under
    ``kill -9`` a rank runs no exit handler; its orphaned writers, reparented to init, escaped Slurm's
    process tracking, outlived the job and held the step's output pipes open, so the step took
    another minute to end (slurmstepd's "Abandoning IO 60 secs after job shutdown").

    This process loses nothing: a signal arriving meanwhile is delivered to another thread or on
    leaving the block, and the Python handler runs in the main thread either way."""
    global _die_with
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        _start_resource_tracker()
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # again: see the docstring
        _arm_death_signal_at_fork()
        _die_with = os.getpid()
        yield
    finally:
        _die_with = None
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _start_resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # once per process; it ignores INT/TERM itself, USR1 is blocked here


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_die_with: int | None = None
"""While a :func:`kept_from_child_processes` block runs: the pid whose forked children die with it."""
_prctl: Any = None


def _arm_death_signal_at_fork() -> None:
    """Register :func:`_after_fork_in_child` once (os.fork runs it in every child Python forks)."""
    global _prctl
    if _prctl is not None or not sys.platform.startswith("linux"):
        return
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: a forked child only calls it
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _after_fork_in_child() -> None:
    global _die_with
    parent, _die_with = _die_with, None  # the child's own children are not bound by this
    if parent is None:
        return
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)
