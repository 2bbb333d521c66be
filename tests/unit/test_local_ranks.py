"""The launcher's failure grace (trainer/launch/local_ranks.py): once a rank fails, its peers are
killed a grace later, not at the deadline, and what the killed ranks' run left in /dev/shm is removed
(their run's segments only). Real processes (tests/unit/launch_victim.py), no torch."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from tests.shm_tag import TAG
from trainer.launch.local_ranks import start_ranks

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 2.0


def test_peers_of_a_failed_rank_are_killed_a_grace_later_and_their_runs_segments_removed(tmp_path):
    stranger = Path(f"/dev/shm/mdpp-{TAG}_t1-c0ffee01-1-0-next")  # another run's, same shape: left alone
    stranger.write_bytes(b"\0" * 64)
    try:
        ranks = start_ranks(["tests.unit.launch_victim"], 3, tmp_path, run_id="u", cwd=REPO,
                            env={"PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 60
        while not all("SEGMENT" in ranks.output(r) for r in (1, 2)):
            assert time.monotonic() < deadline, [ranks.output(r) for r in range(3)]
            assert all(p.poll() is None for p in ranks.procs[1:]), [ranks.output(r) for r in range(3)]
            time.sleep(0.1)
        names = [re.search(r"^SEGMENT (\S+)$", ranks.output(r), re.M).group(1) for r in (1, 2)]
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names) and all(n.startswith(f"mdpp-{TAG}") for n in names)
        started = time.monotonic()
        timed_out = ranks.wait(600, failure_grace_s=GRACE_S)
        took = time.monotonic() - started
        assert not timed_out and GRACE_S <= took < GRACE_S + 20, took
        assert [p.returncode for p in ranks.procs] == [1, -signal.SIGKILL, -signal.SIGKILL]
        assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]
        assert "[launcher] killed rank(s) 1, 2; removed their run's shared-memory segment(s)" in ranks.output(0)
        assert stranger.exists()
    finally:
        stranger.unlink(missing_ok=True)
