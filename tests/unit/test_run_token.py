"""trainer.run_token: one token per run, never taken from torchrun's shared "none" alone."""

from __future__ import annotations

import pytest

from trainer.run_token import MAX_LENGTH, agreed_run_token, launcher_prefix, make_token


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
    assert len(long) <= MAX_LENGTH and long.endswith("-00000001") and "/" not in long and " " not in long


def test_two_runs_without_a_launcher_id_get_different_tokens(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    tokens = {agreed_run_token() for _ in range(20)}  # no process group: drawn locally
    assert len(tokens) == 20 and not any("none" in t for t in tokens)
