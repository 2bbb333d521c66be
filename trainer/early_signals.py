"""Catch USR1/TERM from the first moment of a training process, before torch is imported.

Slurm forwards its pre-timeout/preemption warning (USR1) and TERM to the ranks whenever it comes;
importing torch and megatron takes seconds on a busy node, and a signal in that window would kill
the rank with the default action instead of asking for a checkpoint. trainer/train.py calls
:func:`install_for_main` before importing torch; the handlers only note the signal, and its
PreemptionFlag takes the note over once installed. Imported by tests or tools, nothing is installed.
"""

from __future__ import annotations

import os
import signal
import sys
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
