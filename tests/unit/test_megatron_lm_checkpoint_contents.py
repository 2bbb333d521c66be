"""What of a Megatron-LM torch_dist checkpoint loads besides its weights, decided from its common state
alone (trainer/checkpoint/find.py's facts, trainer/checkpoint/state.py's rule); the loads themselves:
tests/dist/test_megatron_lm_checkpoint.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from trainer.checkpoint.facts import RunFacts
from trainer.checkpoint.find import _megatron_lm_facts
from trainer.checkpoint.megatron_lm import megatron_lm_optimizer_differences


def _common(**args) -> dict:
    base = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2, "world_size": 8, "optimizer": "adam", "fp16": False, "bf16": True,
            "use_distributed_optimizer": True}
    return {"args": argparse.Namespace(**{**base, **args}), "iteration": 3, "checkpoint_version": 3.0,
            "opt_param_scheduler": {"num_steps": 24}}


def _facts(tp: int = 2, pp: int = 2, distributed: bool = True, optimizer: str = "adam", precision: str = "bf16"):
    return RunFacts({"world_size": 8, "tp": tp, "pp": pp, "vp": 1}, 128, distributed, {"optimizer": optimizer},
                    precision)


def test_contents_follow_megatron_lms_save_flags() -> None:
    facts = _megatron_lm_facts(Path("ckpt"), _common())["megatron_lm"]
    assert facts["has_optimizer"] and facts["has_rng"] and facts["precision"] == "bf16"
    # No content metadata (an older Megatron-LM): its loader's sharding for the distributed optimizer.
    assert facts["sharding"]["distrib_optim_sharding_type"] == "dp_zero_gather_scatter"
    skipped = _megatron_lm_facts(Path("ckpt"), {**_common(no_save_optim=True, no_save_rng=True)})["megatron_lm"]
    assert not skipped["has_optimizer"] and not skipped["has_rng"]
    common = {**_common(), "content_metadata": {"distrib_optim_sharding_type": "fully_reshardable",
                                                "singleton_local_shards": False, "dp_cp_group": object()}}
    assert _megatron_lm_facts(Path("ckpt"), common)["megatron_lm"]["sharding"] == {
        "distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False}


@pytest.mark.parametrize(("metadata", "facts", "expected"), [
    ("dp_reshardable", _facts(), []),
    ("dp_reshardable", _facts(tp=1, pp=4),
     ["--tensor-model-parallel-size: checkpoint 2, this run 1", "--pipeline-model-parallel-size: checkpoint 2, this run 4"]),
    ("fully_reshardable", _facts(tp=1, pp=4), []),  # reshards over TP/PP
    ("dp_reshardable", _facts(distributed=False, tp=1), ["--use-distributed-optimizer: checkpoint True, this run False"]),
    ("dp_reshardable", _facts(optimizer="sgd", precision="fp32"),
     ["--optimizer: checkpoint 'adam', this run 'sgd'", "precision (--fp16/--bf16): checkpoint bf16, this run fp32"]),
])
def test_optimizer_state_loads_only_into_the_same_optimizer(metadata, facts, expected) -> None:
    common = {**_common(), "content_metadata": {"distrib_optim_sharding_type": metadata}}
    saved = _megatron_lm_facts(Path("ckpt"), common)
    found = megatron_lm_optimizer_differences(saved, facts)
    assert [d.split(" (the distributed")[0] for d in found] == expected


def test_a_plain_optimizers_state_reshards_with_the_parameters() -> None:
    saved = _megatron_lm_facts(Path("ckpt"), _common(use_distributed_optimizer=False))
    assert megatron_lm_optimizer_differences(saved, _facts(tp=1, pp=4, distributed=False)) == []
