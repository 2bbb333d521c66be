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
    """Block USR1/TERM in this thread while the block runs, so that processes started from it (megatron-core's
    checkpoint writer: a spawned multiprocessing Manager and forked workers) inherit them blocked.

    Why: Slurm delivers a step's signals to every process of the step, children included. A spawned child
    starts with the default actions, and USR1's kills it: the checkpoint that USR1 asked for then died in
    megatron-core's writer (BrokenPipeError from its Manager). A child inherits the signal mask of the
    thread that starts it, and the Manager outlives this block, so it stays immune. This process loses
    nothing: a signal arriving meanwhile is delivered to another thread or on leaving the block, and
    the Python handler runs in the main thread either way."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
