"""Two job steps of one allocation running side by side get different run tokens, and the token
carries the step id ("Shared-memory hygiene" in docs/transport.md#transports): Slurm sets SLURM_STEP_ID in every srun
task, which is how the training ranks start (sbatch/2.distributed-training.sbatch)."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.shm_tag import TAG
from tests.slurm.conftest import REPO

# Each step draws its token with the trainer's own function, leaves it in TOKENS, and waits (bounded)
# until the other step has too: both steps were alive at the same time.
STEP = """
import os, pathlib, time
from trainer.launch.run_token import agreed_run_token
folder, token = pathlib.Path(os.environ["TOKENS"]), agreed_run_token()
(folder / token).touch()
print(token, flush=True)
deadline = time.monotonic() + 60
while len(list(folder.iterdir())) < 2:
    if time.monotonic() > deadline:
        raise SystemExit(f"step {os.environ['SLURM_STEP_ID']}: the other step left no token in {folder} within 60 s")
    time.sleep(0.1)
"""


@pytest.mark.timeout(150)
def test_concurrent_steps_of_one_allocation_get_their_own_token(slurm, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tmp_path / "step.py").write_text(STEP)
    script = tmp_path / "two_steps.sh"
    script.write_text("#!/bin/bash\n"
                      f"srun --exact --ntasks=1 {sys.executable} {tmp_path / 'step.py'} &\n"
                      f"srun --exact --ntasks=1 {sys.executable} {tmp_path / 'step.py'} &\n"
                      "wait -n && wait -n\n")
    env_args = [f"--export=ALL,TOKENS={tokens},PYTHONPATH={REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"]
    job = slurm.run(["--nodes=1", "--ntasks=2", *env_args, str(script)], timeout=120)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()
    assert {job.steps[f"{job.job_id}.{step}"][0] for step in (0, 1)} == {"COMPLETED"}, job.describe()
    made = sorted(p.name for p in tokens.iterdir())
    # --export=ALL passes this test run's tag (tests/shm_tag.py), which goes in front of the step's id.
    tag = re.escape(f"{TAG}_")
    assert len(made) == 2 and all(re.fullmatch(rf"{tag}{job.job_id}\.[01]-[0-9a-f]{{8}}", t) for t in made), made
    assert sorted(t.split("-")[0] for t in made) == [f"{TAG}_{job.job_id}.0", f"{TAG}_{job.job_id}.1"], made
    assert sorted(job.output.split()) == made, job.describe()
