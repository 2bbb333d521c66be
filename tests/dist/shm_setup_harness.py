"""Make one rank go wrong in the middle of the shared-memory set-up: after it created its receive
rings (their names are in /dev/shm) and before any sender attached and unlinked them -- the one
window in which a run's segments are visible.

``python -m tests.dist.shm_setup_harness MODE VICTIM -- <trainer.train flags>``: the real
``trainer.train.main`` on every rank, rank VICTIM doing MODE at that point:

- ``kill``: SIGKILL itself (nothing of it runs again: its peers must clean up after it);
- ``raise``: raise an error the set-up does not expect (it leaves the set-up without the collective
  that would tell its peers);
- ``stall``: stop answering for STALL_S, so that its peers' set-up collective times out (a peer that
  never arrived), then exit 3;
- ``leftover``: go on normally, but after the first step create one more segment under the run's
  token that nothing unlinks (what a bug would leave): the run ends normally, and its last act must
  remove it. (Made late rather than at set-up: on a shared host a file left long in /dev/shm may be
  removed by something else.)

Before acting, the victim prints ``SEGMENTS {"job": ..., "names": [...]}``: the run's job id and the
names of it in /dev/shm, so a test can check that the window was really hit. The mocks stop here: the injection point is a patch,
the processes, segments, signals and clean-up are real.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from trainer.names import is_segment_of, ring_name
from trainer.train import TrainHooks, main
from trainer.transport import shm_links

STALL_S = 120.0  # longer than any test waits: the test kills it, as a launcher would
MODES = ("kill", "raise", "stall", "leftover")


class InjectedSetupError(Exception):
    """Not an OSError/RuntimeError/ValueError: the set-up phases do not catch it."""


def run_segments(job: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if is_segment_of(job, name))


def inject(mode: str, victim: int) -> TrainHooks:
    """Patch this process's shared-memory set-up so that rank ``victim`` does ``mode`` (see above);
    the hooks to run ``trainer.train.main`` with in this process."""
    assert mode in MODES, mode
    original_open, original_phases = shm_links.open_rings, shm_links._set_up_in_phases
    seen: dict[str, str] = {}

    def open_rings(specs, rank, job, group, num_slots, slot_bytes):  # noqa: ANN001, ANN202
        seen["job"] = job
        return original_open(specs, rank, job, group, num_slots, slot_bytes)

    def leave_a_segment(iteration: int, losses: dict[str, float]) -> None:
        if "left" not in seen:
            seen["left"] = ring_name(seen["job"], 98, 99, "next").lstrip("/")  # no rank has that number
            with open(f"/dev/shm/{seen['left']}", "wb") as segment:
                segment.write(b"\0" * 4096)
            print("LEFTOVER", json.dumps(seen["left"]), flush=True)

    def set_up_in_phases(phases, rank, group, clean_up):  # noqa: ANN001, ANN202
        if rank == victim and mode != "leftover" and phases[0][0] == "create":
            phases[0][1]()  # this rank's receive rings now exist, named
            print("SEGMENTS", json.dumps({"job": seen["job"], "names": run_segments(seen["job"])}), flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "raise":
                raise InjectedSetupError(f"rank {rank}: injected error in the middle of the shared-memory set-up")
            time.sleep(STALL_S)
            os._exit(3)
        return original_phases(phases, rank, group, clean_up)

    shm_links.open_rings, shm_links._set_up_in_phases = open_rings, set_up_in_phases
    return TrainHooks(after_step=leave_a_segment) if mode == "leftover" else TrainHooks()


if __name__ == "__main__":
    mode, victim, separator, *train_args = sys.argv[1:]
    assert separator == "--", "usage: shm_setup_harness MODE VICTIM -- <trainer.train flags>"
    hooks = inject(mode, int(victim)) if int(os.environ["RANK"]) == int(victim) else TrainHooks()
    sys.exit(main(train_args, hooks))
