"""trainer.launch.run_token and trainer.names: one token per run, never taken from torchrun's shared "none" alone."""

from __future__ import annotations

import pytest

from tests.shm_tag import TAG
from trainer.launch.run_token import RUN_TAG_ENV, agreed_run_token, remove_run_segments, token_prefix
from trainer.names import (
    RUN_TOKEN_MAX_LENGTH,
    doorbell_name,
    is_segment_of,
    job_name_part,
    launcher_prefix,
    make_token,
    ring_name,
    tp_decision_name,
)


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


def test_a_tag_goes_in_front_of_the_launcher_id_and_survives_truncation():
    env = {RUN_TAG_ENV: "ci7", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}
    assert token_prefix(env) == "ci7_42.0-r1"
    assert make_token(token_prefix(env), 0xDEADBEEF) == "ci7_42.0_r1-deadbeef"
    assert token_prefix({RUN_TAG_ENV: "ci7"}) == "ci7" and token_prefix({}) == ""
    long = make_token(token_prefix({**env, RUN_TAG_ENV: "tag", "SLURM_JOB_ID": "9" * 60}), 1)
    assert long.startswith("tag_999") and long.endswith("-00000001") and len(long) <= RUN_TOKEN_MAX_LENGTH


def test_this_test_run_draws_tokens_with_its_tag():
    assert agreed_run_token().startswith(TAG)  # tests/conftest.py set it before any test ran


SEGMENTS_OF_A_RUN = ["mdpp-42.0-deadbeef-0-1-next", "mdpp-42.0-deadbeef-1-0-prev", "mdpp-42.0-deadbeef-1-bell",
                     "mdpp-42.0-deadbeef-pp3-dp0-tpdecide"]
NOT_ITS_OWN = [
    "mdpp-42.0-deadbeef-1-0-1-next",  # ring 0->1 of the run "42.0-deadbeef-1"
    "mdpp-42.0-deadbeef-1-0-bell",  # a doorbell of that run
    "mdpp-42.0-deadbeefx-0-1-next", "mdpp-42.0-deadbee-0-1-next", "mdpp-42.0-deadbeef-0-1-sideways",
    "mdpp-42.0-deadbeef-a-bell", "mdpp-42.0-deadbeef-ppx-dp0-tpdecide", "mdpp-42.1-deadbeef-0-1-next",
    "mdpp-42.0-deadbeef", "torch_1234_0", "other-42.0-deadbeef-0-1-next",
]


def test_a_run_knows_its_own_segment_names_and_no_one_elses():
    assert [is_segment_of("42.0-deadbeef", n) for n in SEGMENTS_OF_A_RUN] == [True] * len(SEGMENTS_OF_A_RUN)
    assert [n for n in NOT_ITS_OWN if is_segment_of("42.0-deadbeef", n)] == []
    token = "42.0-deadbeef"  # every name maker's output is recognised
    made = [ring_name(token, 3, 4, "prev"), doorbell_name(token, 12), "/" + tp_decision_name(token, 1, 2)]
    assert all(is_segment_of(token, name.lstrip("/")) for name in made), made


def test_remove_run_segments_removes_the_runs_own_names_only(tmp_path):
    for name in SEGMENTS_OF_A_RUN + NOT_ITS_OWN:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_run_segments("42.0-deadbeef", tmp_path)) == sorted(SEGMENTS_OF_A_RUN)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NOT_ITS_OWN)
    assert remove_run_segments("42.0-deadbeef", tmp_path) == []  # again: nothing left to do
    assert remove_run_segments(None, tmp_path) == []  # no token drawn yet (failed before): nothing
