"""trainer.launch.early_signals in a fresh interpreter (it changes process-wide signal dispositions): as
``__main__`` it notes USR1/TERM instead of dying and marks the rank ready in $MDPP_READY_DIR, which
the training batch script waits for before forwarding a signal; imported by anything else it does
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROBE = """
import os, signal, sys
from trainer.launch import early_signals
early_signals.install_for_main(sys.argv[1])
os.kill(os.getpid(), signal.SIGUSR1)
print("alive", early_signals.received)
"""


def _probe(module_name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, module_name], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, cwd=Path(__file__).resolve().parents[2])


def test_main_notes_signals_and_marks_its_rank_ready(tmp_path: Path) -> None:
    done = _probe("__main__", {"MDPP_READY_DIR": str(tmp_path), "SLURM_PROCID": "3"})
    assert done.returncode == 0 and "alive ['SIGUSR1']" in done.stdout, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["rank3"]


def test_an_unwritable_ready_dir_is_reported_not_fatal(tmp_path: Path) -> None:
    done = _probe("__main__", {"MDPP_READY_DIR": str(tmp_path / "missing"), "SLURM_PROCID": "0"})
    assert done.returncode == 0 and "alive" in done.stdout
    assert "cannot mark rank 0 ready" in done.stderr


def test_imported_it_installs_nothing_and_marks_nothing(tmp_path: Path) -> None:
    done = _probe("trainer.train", {"MDPP_READY_DIR": str(tmp_path)})
    assert done.returncode == -10  # SIGUSR1's default action: the probe never printed
    assert list(tmp_path.iterdir()) == []


CHILD_PROBE = """
import multiprocessing as mp, os, signal, sys, time
from trainer.launch import early_signals
signal.signal(signal.SIGUSR1, lambda *a: print("parent noted USR1", flush=True))
signal.signal(signal.SIGTERM, lambda *a: print("parent noted TERM", flush=True))
if sys.argv[1] == "kept":
    with early_signals.kept_from_child_processes():
        manager = mp.get_context("spawn").Manager()  # what megatron-core's checkpoint writer starts
else:
    manager = mp.get_context("spawn").Manager()
queue = manager.Queue()
for sig in (signal.SIGUSR1, signal.SIGTERM):  # Slurm signals every process of the step
    os.kill(manager._process.pid, sig)
    os.kill(os.getpid(), sig)
time.sleep(1)
try:
    queue.put(1)
    print("manager alive", queue.get())
except Exception as exc:
    print("manager dead", type(exc).__name__)
"""


def _child_probe(mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", CHILD_PROBE, mode], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_spawned_child_dies_of_usr1_and_term_unless_started_inside_the_block() -> None:
    # The control: without the block the writer's Manager dies (what broke checkpoints on a signal
    # under Slurm). Inside it, the spawn comes after Python's resource tracker started, whose start
    # unblocks TERM: the block must still hold TERM for the Manager.
    assert "manager dead" in _child_probe("plain")
    out = _child_probe("kept")
    assert "manager alive 1" in out
    assert "parent noted USR1" in out and "parent noted TERM" in out  # the parent still gets its own signals


ORPHAN_PROBE = """
import os, sys, time
from trainer.launch import early_signals
if os.fork() == 0:  # the 'rank'
    with early_signals.kept_from_child_processes():
        if sys.argv[1] == "forked-inside":
            child = os.fork()
        else:
            child = None
    if child is None:
        child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(30)
"""


def _orphan_survives(mode: str, watch_s: float = 10.0) -> tuple[bool, float]:
    """A 'rank' forks a child inside or outside the block and is killed with SIGKILL: does the child live on
    for ``watch_s``? (answer, seconds until it was seen gone)."""
    import signal
    import time

    probe = subprocess.Popen([sys.executable, "-c", ORPHAN_PROBE, mode], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        child = int(probe.stdout.readline())
        rank = int(Path(f"/proc/{child}/stat").read_text().split(") ")[1].split()[1])  # its parent
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() < killed + watch_s:
            state = Path(f"/proc/{child}/stat").read_text().split(") ")[1].split()[0] \
                if Path(f"/proc/{child}/stat").exists() else "gone"
            if state in ("gone", "Z"):
                return False, time.monotonic() - killed
            time.sleep(0.05)
        os.kill(child, signal.SIGKILL)
        return True, watch_s
    finally:
        probe.kill()
        probe.wait()


def test_a_child_forked_inside_the_block_dies_with_its_parent() -> None:
    survived, died_after_s = _orphan_survives("forked-inside")
    assert not survived
    # The control: an ordinary fork outlives kill -9, watched several times as long as the inside one
    # took to die (that scales with the machine's load; a fixed 10 s watch cost every run 10 s).
    assert _orphan_survives("forked-outside", watch_s=max(1.0, 5 * died_after_s))[0]
