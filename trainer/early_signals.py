"""Catch USR1/TERM from the first moment of a training process, before torch is imported.

Slurm forwards its pre-timeout/preemption warning (USR1) and TERM to the ranks whenever it comes;
importing torch and megatron takes seconds on a busy node, and a signal in that window would kill
the rank with the default action instead of asking for a checkpoint. trainer/train.py calls
:func:`install_for_main` before importing torch; the handlers only note the signal, and its
PreemptionFlag takes the note over once installed. Imported by tests or tools, nothing is installed.
"""

from __future__ import annotations

import signal
from typing import Any

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
received: list[str] = []
"""Names of the signals noted so far, oldest first."""


def _note(signum: int, frame: Any) -> None:
    received.append(signal.Signals(signum).name)


def install_for_main(module_name: str) -> None:
    """Install the noting handlers when ``module_name`` is ``"__main__"`` (``python -m trainer.train``)."""
    if module_name == "__main__":
        for sig in SIGNALS:
            signal.signal(sig, _note)
