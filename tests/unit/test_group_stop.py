"""trainer/launch/group_stop.py: the benchmark runner's and the local chain's way to stop a child and all
it started. Real processes: a leader that ends on SIGTERM and a grandchild that ignores it (as a rank
stuck in a collective would), which must not outlive the stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from trainer.launch.group_stop import stop_group

# The grandchild ignores SIGTERM and prints its pid; the leader prints it on and sleeps (SIGTERM ends it).
GRANDCHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"
LEADER = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}],"
          " stdout=subprocess.PIPE, text=True); c.stdout.readline(); print(c.pid, flush=True); time.sleep(300)")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "\nState:\tZ" in status.read()  # dead, not yet reaped by whoever adopted it
    except FileNotFoundError:
        return True


def test_the_group_is_stopped_even_where_a_member_ignores_sigterm() -> None:
    proc = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    grandchild = int(proc.stdout.readline())
    started = time.monotonic()
    out, _err = stop_group(proc, grace_s=2.0)
    try:
        assert proc.returncode is not None and proc.returncode < 0, proc.returncode  # ended by a signal
        assert out == "" and _err is None
        deadline = time.monotonic() + 10  # SIGKILL was sent; the kernel may take a moment
        while not _gone(grandchild) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(grandchild), f"grandchild {grandchild} ignored SIGTERM and outlived stop_group"
        assert time.monotonic() - started < 30, "stop_group took longer than its two grace periods"
    finally:
        if not _gone(grandchild):
            os.kill(grandchild, 9)


def test_a_group_that_already_ended_is_collected_without_error() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "print('done')"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stop_group(proc, grace_s=1.0) == ("done\n", None)
