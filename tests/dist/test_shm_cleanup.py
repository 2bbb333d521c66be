"""Nothing of a run is left in /dev/shm however it ends: a rank SIGKILLed, raising, or never arriving
in the middle of the shared-memory set-up (the one window in which segments have names), or a run
ending normally with a segment nobody unlinked. Two real ``trainer.train`` ranks (PP=2, shm links,
one host); tests/dist/shm_setup_harness.py makes rank 1 go wrong at that point.

Who removes what (docs/transport.md, "Shared-memory hygiene"): every rank of a run knows its token,
so the survivors on the host remove ``/dev/shm/mdpp-<token>-*`` when the set-up fails and again as
each one's last act; a SIGKILLed rank cannot, its peer does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.dist.launch import start
from tests.model_flags import model_flags
from tests.shm_tag import TAG
from trainer.names import is_segment_of

TIMEOUT_S = 20  # --dpp-timeout: how long the survivor waits for a peer that never arrives
ARGS = [*model_flags(seq=32, vocab=None), "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--use-dpp", "--transport", "shm",
        "--dpp-timeout", str(TIMEOUT_S)]


def run_segments(job: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if is_segment_of(job, name))


def _run(mode: str) -> tuple[list, list[str]]:
    """Both ranks' results and outputs, rank 1 doing ``mode``. Once rank 0 has exited, a rank 1 still
    running (one that stalls) is SIGKILLed, as torchrun or srun tear a job down when one rank failed."""
    ranks = start(["tests.dist.shm_setup_harness", mode, "1", "--", *ARGS], 2)
    deadline = time.monotonic() + 240
    while ranks.procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    results = ranks.wait(timeout_s=0 if mode == "stall" else 30)
    return results, [r.output for r in results]


def _reported(output: str, key: str):
    found = re.search(rf"^{key} (.+)$", output, re.M)
    assert found, f"the victim never printed {key}:\n{output[-3000:]}"
    return json.loads(found.group(1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["kill", "raise", "stall"])
def test_a_rank_lost_mid_setup_leaves_nothing_of_the_run(mode):
    results, (survivor, victim) = _run(mode)
    seen = _reported(victim, "SEGMENTS")
    job, names = seen["job"], seen["names"]
    assert job.startswith(TAG), job  # the run's token carries this test run's tag (tests/shm_tag.py)
    # The window was hit: the victim's receive ring existed, under the run's token, when it went wrong.
    assert f"mdpp-{job}-0-1-next" in names, names
    expected_victim_code = {"kill": -signal.SIGKILL, "raise": 1, "stall": -signal.SIGKILL}[mode]
    assert results[1].returncode == expected_victim_code, victim[-3000:]
    assert results[0].returncode == 1, survivor[-3000:]
    # The survivor says what went wrong where. A dead victim's ring is removed by the survivor, which
    # says so; a raising victim removes its own on the way out. (A stalled victim's ring waits
    # --dpp-timeout seconds in /dev/shm: on a shared host something else may remove it meanwhile --
    # a leak check that looked at the whole of /dev/shm did -- so there only the outcome is checked.)
    assert "shared-memory set-up (create)" in survivor and "rank 0" in survivor, survivor[-3000:]
    if mode != "stall":
        remover = victim if mode == "raise" else survivor
        assert f"mdpp-{job}-0-1-next" in remover and "shared-memory segment(s) run" in remover, remover[-3000:]
    if mode == "raise":
        assert "InjectedSetupError" in victim, victim[-3000:]
    assert run_segments(job) == []


@pytest.mark.timeout(300)
def test_a_run_ending_normally_removes_a_segment_nobody_unlinked():
    results, outputs = _run("leftover")
    assert [r.returncode for r in results] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    name = _reported(outputs[1], "LEFTOVER")
    job = name[len("mdpp-"):-len("-98-99-next")]
    assert name in outputs[0] + outputs[1]  # whichever rank ended last removed it, and said so
    assert run_segments(job) == []
