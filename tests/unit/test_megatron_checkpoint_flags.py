"""Megatron-LM's checkpoint and exit flags: accepted with Megatron-LM's names (both spellings of the
scheduler flags), refused where they cannot be honoured, and what a load restores under each."""

from __future__ import annotations

import pytest

from trainer.checkpoint.state import SCHEDULE_KEYS, TRAINING_KEYS, _compared_identity, run_identity
from trainer.config import ConfigError, parse_config

BASE = ["--mock-data", "--num-layers", "2", "--device", "cpu"]


def _cfg(*flags: str):
    return parse_config(BASE + list(flags), world_size=1)


def test_accepted_with_megatron_lm_names() -> None:
    c = _cfg("--ckpt-format", "torch_dist", "--exit-signal-handler", "--exit-duration-in-mins", "230").checkpoint
    assert (c.ckpt_format, c.exit_signal_handler, c.exit_duration_in_mins) == ("torch_dist", True, 230)
    for spelling in ("--override-opt_param-scheduler", "--override-opt-param-scheduler"):
        assert _cfg(spelling).checkpoint.override_opt_param_scheduler
    for spelling in ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"):
        assert _cfg(spelling).checkpoint.use_checkpoint_opt_param_scheduler
    c = _cfg("--finetune", "--no-load-optim", "--no-load-rng").checkpoint
    assert (c.finetune, c.loads_optimizer, c.loads_rng) == (True, False, False)
    c = _cfg("--no-load-rng").checkpoint
    assert (c.loads_optimizer, c.loads_rng) == (True, False)


def test_refused_where_they_cannot_be_honoured() -> None:
    with pytest.raises(ConfigError) as err:
        _cfg("--ckpt-format", "torch", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
             "--exit-duration-in-mins", "0")
    assert err.value.problems == [
        "--ckpt-format='torch': checkpoints here are megatron-core's torch_dist only (Megatron-LM's default); torch "
        "(legacy), zarr, fsdp_dtensor and torch_dcp are not written or read",
        "--exit-duration-in-mins=0 must be >= 1",
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give one (the LR schedule from "
        "this command line, or from the checkpoint)"]


def test_what_a_load_compares_with_the_checkpoint() -> None:
    plain = _cfg()
    identity = run_identity(plain)
    assert _compared_identity(identity, plain.checkpoint) == identity
    assert _compared_identity(identity, None) == identity
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler", "--no-load-optim"):
        assert set(_compared_identity(identity, _cfg(flag).checkpoint)) == set(identity) - SCHEDULE_KEYS
    # --finetune: only the model must match (a fine-tuning run picks its own LR, seed and batch).
    kept = set(_compared_identity(identity, _cfg("--finetune").checkpoint))
    assert kept == set(identity) - TRAINING_KEYS
    assert {"num_layers", "hidden_size", "normalization", "swiglu", "num_query_groups"} <= kept
