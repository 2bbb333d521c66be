"""This test run's tag on every shared-memory name it makes: how a test tells its own segments from
those of any other run on the host (a second clone's tests, a training job, a developer's ranks).

conftest.py puts TAG in the environment (trainer.launch.run_token.RUN_TAG_ENV) before any test starts, so
every run token a test's ranks draw -- in-process, in forked ranks, in ``python -m`` ranks, in Slurm
jobs submitted with the test's environment -- begins with it; a test that names its own job passes
:func:`tagged`. The leak check in conftest.py then looks at ``/dev/shm/mdpp-<TAG>*`` and nothing else.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from trainer.launch.run_token import RUN_TAG_ENV

SHM = Path("/dev/shm")
# One per pytest process (random: two clones, or two runs of one clone, never share it). A harness
# around pytest (scripts/stress_tests.sh) may set its own tag: ours goes after it, so its check finds
# every round's segments and ours still tells this process's apart.
TAG = "_".join(part for part in (os.environ.get(RUN_TAG_ENV, ""), f"pt{secrets.token_hex(4)}") if part)


def tagged(label: str) -> str:
    """A job id for ``make_stage_links(job_id=...)`` or a segment name, carrying this run's tag."""
    return f"{TAG}_{label}"


def our_segments() -> set[str]:
    """Names in /dev/shm that this test run's ranks made (every one begins ``mdpp-<TAG>``)."""
    head = f"mdpp-{TAG}"
    return {e.name for e in os.scandir(SHM) if e.name.startswith(head)} if SHM.is_dir() else set()
