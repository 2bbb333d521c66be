"""`workflows.submit` refuses, before submitting, what the real cluster cannot run.

Before: `--nodes 4` on this two-node partition submitted a chain that pended forever, and an
`--image` pointing nowhere was submitted anyway.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _submit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflows.submit", "gpt", *args, "--runs-dir",
                           str(tmp_path / "runs")], cwd=REPO, env=dict(os.environ), capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "4", "--env", "PP=4"], "--nodes 4: partition debug has 2 node(s); the job would pend forever"),
    (["--partition", "nosuch"], "--partition nosuch: no such partition (this cluster has: debug)"),
    (["--image", "./no-such-image.sqsh", "--nodes", "4", "--env", "PP=4"],
     "--image ./no-such-image.sqsh: no such file (build one with containers/build.sh, or "
     "containers/build-offline.sh for the CPU image, or name a registry image such as "
     "nvcr.io#nvidia/pytorch:24.07-py3); --nodes 4: partition debug has 2 node(s)"),
])
def test_submit_refuses_before_submitting(tmp_path, args, message):
    done = _submit(tmp_path, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    # chain.submit writes the run folder (sbatch/, logs/) before its first sbatch: no folder, no job.
    # (Counting jobs in sacct would race with other users of the cluster.)
    assert done.stdout == "" and not (tmp_path / "runs").exists()
