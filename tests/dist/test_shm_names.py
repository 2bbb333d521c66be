"""Shared-memory names are unique per run without `torchrun --standalone`, and a segment a killed run
left behind does not block a later one, nor does a later run remove it.

Before: torchrun without --standalone/--rdzv-id sets TORCHELASTIC_RUN_ID=none for every job, the
trainer named its segments after the launcher's id alone (/mdpp-none-...), and segments are created
O_EXCL: a second job on the host (or the leftovers of a SIGKILLed one) made set-up fail with "File
exists". The leftovers planted here are exactly those names, spelled from this test run's own prefix
(tests/shm_tag.py) so that no other run on the host can see or trip over them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.dist.launch import check_ok, free_port, launch
from tests.model_flags import model_flags
from tests.shm_tag import TAG
from trainer.launch.run_token import token_prefix
from trainer.names import doorbell_name, ring_name
from trainer.transport.factory import _agreed_job_id

SHM = Path("/dev/shm")
NONE_ENV = {"TORCHELASTIC_RUN_ID": "none"}  # what torchrun sets without --standalone or --rdzv-id


def _old_names() -> list[str]:
    """What a PP=2 run named by its launcher's id alone creates: the receivers' rings and doorbells
    (trainer/transport/shm_links.py) -- here with this test run's tag in front, as every run of it has."""
    job = token_prefix({**os.environ, **NONE_ENV})
    assert job, "tests/conftest.py sets the run tag: the prefix is never empty here"
    return [name.lstrip("/") for name in (ring_name(job, 0, 1, "next"), ring_name(job, 1, 0, "prev"),
                                          doorbell_name(job, 0), doorbell_name(job, 1))]


def _train(profile_dir: Path) -> str:
    args = ["trainer.train", *model_flags(seq=32, vocab=None), "--pipeline-model-parallel-size", "2",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--use-dpp",
            "--transport", "shm", "--dpp-timeout", "60", "--profile-dir", str(profile_dir)]
    results = launch(args, 2, timeout_s=200, extra_env=NONE_ENV)
    check_ok(results)
    return "".join(r.output for r in results)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
def test_runs_named_none_by_torchrun_do_not_collide_or_trip_over_leftovers(tmp_path, monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    leftovers = [SHM / name for name in _old_names()]
    try:
        for path in leftovers:  # segments of a killed earlier run, under the names "none" gave
            path.write_bytes(b"\0" * 4096)
            path.chmod(0o600)
        outputs = _train(tmp_path / "a") + _train(tmp_path / "b")
        # Each run's last act removes its own segments only (and names each one it removes): another
        # run's are not its to remove. (Read from the logs, not from /dev/shm: on a shared host
        # something else may remove the planted files meanwhile.)
        assert not [p.name for p in leftovers if p.name in outputs], outputs[-3000:]
    finally:
        for path in leftovers:
            path.unlink(missing_ok=True)
    run_ids = [json.loads((tmp_path / run / "trace_rank00000.json").read_text())["metadata"]["run_id"]
               for run in ("a", "b")]
    assert run_ids[0] != run_ids[1] and not any(r.startswith("none") for r in run_ids), run_ids
    assert all(r.startswith(TAG) for r in run_ids), run_ids  # what lets the leak check find this run's segments


def test_the_transport_default_token_is_a_run_token(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        tokens = {_agreed_job_id(None, dist.group.WORLD) for _ in range(5)}
    finally:
        dist.destroy_process_group()
    assert len(tokens) == 5 and not any(t.startswith("none") for t in tokens), tokens
    assert _agreed_job_id("42.0-deadbeef", None) == "42.0-deadbeef"
