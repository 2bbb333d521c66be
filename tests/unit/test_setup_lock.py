"""scripts/setup.sh takes a host-wide lock: two checkouts' set-ups at once (two clones' `make test`)
would otherwise run pip's editable install of this package into the one shared environment together,
which broke one of them. The second waits, bounded, and says which lock it waited for."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_second_setup_waits_for_the_first_and_gives_up_naming_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "setup.lock"
    env = {**os.environ, "MDPP_SETUP_LOCK": str(lock), "MDPP_SETUP_LOCK_WAIT_S": "1"}
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another checkout's set-up, running
        result = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"another checkout's set-up held {lock} for 1 s" in result.stderr
    assert "setup: ok" not in result.stdout and "installing" not in result.stdout  # nothing ran
