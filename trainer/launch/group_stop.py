"""Stopping a child and everything it started: SIGTERM to its process group, SIGKILL what outlives a grace.

The child must lead its own process group (``subprocess.Popen(..., start_new_session=True)``), so that
the group is exactly the child, the ranks it launched and their helpers, and nothing of the caller.
Standard library only: workflows/ (the local chain's steps) uses it as well as the benchmark runner
(tests/unit/test_import_boundary.py holds it to that).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

__all__ = ["stop_group"]


def stop_group(proc: subprocess.Popen, grace_s: float) -> tuple[str | None, str | None]:
    """SIGTERM ``proc``'s process group; SIGKILL it when ``proc`` outlives ``grace_s``; then give the rest of
    the group (ranks finishing their step after SIGTERM, as the trainer does) ``grace_s`` to end and SIGKILL
    whatever is left. Returns what ``proc.communicate`` still collected: (stdout, stderr), None for a stream
    that was not a pipe (or when even SIGKILL left ``proc`` running past ``grace_s``)."""
    out = err = None
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group is gone already
            return proc.communicate()
        try:
            out, err = proc.communicate(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    _reap_group(proc.pid, grace_s)
    return out, err


def _reap_group(pgid: int, grace_s: float) -> None:
    """Wait up to ``grace_s`` for the rest of the group to end after its leader, then SIGKILL what is left.
    The leader (torchrun, the benchmark tool) may end first, leaving ranks behind that still hold ports,
    shared memory and cores."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
