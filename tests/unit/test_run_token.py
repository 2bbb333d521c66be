"""trainer.run_token and trainer.names: one token per run, never taken from torchrun's shared "none" alone."""

from __future__ import annotations

import pytest

from trainer.names import (
    RUN_TOKEN_MAX_LENGTH,
    doorbell_name,
    job_name_part,
    launcher_prefix,
    make_token,
    ring_name,
    tp_decision_name,
)
from trainer.run_token import agreed_run_token


@pytest.mark.parametrize(("env", "prefix"), [
    ({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "x"}, "42.0"),
    ({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"}, "42.0-r2"),  # requeued
    ({"SLURM_JOB_ID": "42"}, "42"),
    ({"TORCHELASTIC_RUN_ID": "exp7"}, "exp7"),
    ({"TORCHELASTIC_RUN_ID": "none"}, ""),  # torchrun without --standalone/--rdzv-id: every job's id
    ({}, ""),
])
def test_launcher_prefix(env, prefix):
    assert launcher_prefix(env) == prefix


def test_token_keeps_the_random_suffix_and_only_safe_characters():
    assert make_token("42.0", 0xDEADBEEF) == "42.0-deadbeef"
    assert make_token("", 5) == "00000005"
    long = make_token("a/b c" * 20, 1)
    assert len(long) <= RUN_TOKEN_MAX_LENGTH and long.endswith("-00000001") and "/" not in long and " " not in long


def test_two_runs_without_a_launcher_id_get_different_tokens(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    tokens = {agreed_run_token() for _ in range(20)}  # no process group: drawn locally
    assert len(tokens) == 20 and not any("none" in t for t in tokens)


def test_two_steps_of_one_allocation_never_share_a_segment_name():
    # Two job steps side by side on one host (srun --exact): even if both drew the same random
    # suffix, the step id keeps every shared-memory name apart.
    steps = [launcher_prefix({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": step}) for step in ("0", "1")]
    tokens = [make_token(prefix, 0xDEADBEEF) for prefix in steps]
    assert tokens == ["42.0-deadbeef", "42.1-deadbeef"]
    names = [{ring_name(t, 0, 1, "next"), doorbell_name(t, 1), "/" + tp_decision_name(t, 0, 0)} for t in tokens]
    assert not names[0] & names[1], names
    assert names[0] == {"/mdpp-42.0-deadbeef-0-1-next", "/mdpp-42.0-deadbeef-1-bell",
                        "/mdpp-42.0-deadbeef-pp0-dp0-tpdecide"}


def test_a_caller_job_id_keeps_only_safe_characters():
    assert job_name_part("42.0-deadbeef") == "42.0-deadbeef"  # a run token passes unchanged
    assert job_name_part("a/b c" * 20) == ("a_b_c" * 20)[:RUN_TOKEN_MAX_LENGTH]
