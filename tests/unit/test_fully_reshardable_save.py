"""The distributed optimizer's fully reshardable save cuts each parameter's state at its own place
(trainer.megatron.compat.fully_reshardable_bucket_offsets), on megatron-core itself (CPU, gloo world of 1).

A GPT of two layers under megatron's DDP with small buckets (megatron buckets only with
--overlap-grad-reduce; the distributed optimizer gives a pipeline's shared embedding a bucket of its
own either way): several buckets, the ends padded to 128 elements, so every parameter after the first
padded end is one that megatron-core 0.16 cuts from a later position of the gathered state. fp32 with the distributed optimizer keeps the parameters
themselves as its main parameters, so each parameter's saved ``param`` must equal the parameter.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from trainer.megatron.compat import apply_cpu_shims, fully_reshardable_bucket_offsets


@pytest.fixture(scope="module")
def optimizer_and_model():
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shims = apply_cpu_shims()
    ps.initialize_model_parallel()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
            gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                           max_sequence_length=16)
            model = DistributedDataParallel(config=config, module=gpt, ddp_config=DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=3000))
            optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
                                               [model])
            for p in model.parameters():  # one step, so that the moments are not all zero
                p.main_grad.copy_(torch.randn_like(p.main_grad))
            optimizer.step()
        yield optimizer, model
    finally:
        ps.destroy_model_parallel()
        shims.remove()
        if created:
            dist.destroy_process_group()


def _saved(optimizer, model, kind: str) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """(key, offset) -> (the saved ``kind`` state, the parameter)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from trainer.checkpoint.state import _sharding_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"model": model.module.sharded_state_dict(metadata=_sharding_metadata(True))}
        with fully_reshardable_bucket_offsets():
            saved = optimizer.sharded_state_dict(state, is_loading=False, metadata=_sharding_metadata(True))
    by_key = {(t.key, t.global_offset): t.data for t in state["model"].values() if hasattr(t, "key")}
    prefix = f"optimizer.state.{kind}."
    return {(t.key, t.global_offset): (t.data, by_key[t.key[len(prefix):], t.global_offset])
            for t in nested_values(saved) if getattr(t, "key", "").startswith(prefix)}


def test_every_parameters_saved_state_is_its_own(optimizer_and_model) -> None:
    optimizer, model = optimizer_and_model
    buffer = optimizer.chained_optimizers[0].buffers[0]
    padded = [b for b in buffer.buckets[:-1] if b.grad_data.numel() > b.numel_unpadded]
    assert len(buffer.buckets) >= 3 and padded, "the model must have padded bucket ends before its last bucket"
    saved = _saved(optimizer, model, "param")
    assert len(saved) == len(list(model.parameters()))
    wrong = sorted(key for key, (state, param) in saved.items() if not torch.equal(state, param))
    assert not wrong, f"saved at another parameter's place: {wrong}"
    # The moments are cut the same way: each parameter's own (one rank holds every shard here).
    dist_opt = optimizer.chained_optimizers[0]
    moments = _saved(optimizer, model, "exp_avg")
    wrong = sorted(key for key, (state, param) in moments.items() if not torch.equal(
        state, dist_opt._get_main_param_and_optimizer_states(param)["exp_avg"].view(param.shape)))
    assert len(moments) == len(saved) and not wrong, wrong


def test_the_correction_is_undone_after_the_save(optimizer_and_model) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    before = DistributedOptimizer.sharded_param_state_fully_reshardable
    with fully_reshardable_bucket_offsets():
        assert DistributedOptimizer.sharded_param_state_fully_reshardable is not before
    assert DistributedOptimizer.sharded_param_state_fully_reshardable is before
    optimizer, _ = optimizer_and_model
    assert all("get_parameter_state_dp_zero" not in vars(sub) for sub in optimizer.chained_optimizers)
