"""trainer.model.layer_parts on megatron-core itself (CPU, one process, gloo world of 1).

A world of one has one pipeline stage, which cannot hold half a layer; megatron-core's layout class
reads the stage from parallel_state, so the stages of a PP=2 split are built here by answering that
rank (``monkeypatch``). Both stages' checkpoint tensors must together be the whole model's: the same
keys at the same global layer offsets, each exactly once (a split layer's halves disjoint).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from trainer.model.layer_parts import parts_block_spec, stage_parts_layout
from trainer.schedule.stage_parts import stage_offsets, stage_parts

SPLIT = (4.5, 4, 4, 3.5)


@pytest.fixture(scope="module")
def parallel_state():
    """megatron-core's parallel state over a one-rank gloo group (scripts/layer_halves_probe.py's way)."""
    from megatron.core import parallel_state as ps

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel()
    yield ps
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def test_the_layout_gives_megatron_each_stage_offset_and_count(parallel_state) -> None:
    """Offsets by layer (stage 1 starts with layer 4's MLP: offset 4, not the 5 parts before it),
    counts by part; the embedding on stage 0 and the loss on the last, as megatron's own layout."""
    from megatron.core.transformer.enums import LayerType

    layout = stage_parts_layout(SPLIT, 4)
    for rank, parts in enumerate(stage_parts(SPLIT)):
        assert layout.get_layer_offset(pp_rank=rank) == stage_offsets(SPLIT)[rank]
        assert layout.get_num_layers_to_build(pp_rank=rank) == len(parts)
        assert layout.get_layer_id_list(pp_rank=rank) == sorted({p.layer for p in parts})
        assert layout.get_num_layers_to_build(LayerType.embedding, pp_rank=rank) == (rank == 0)
        assert layout.get_num_layers_to_build(LayerType.loss, pp_rank=rank) == (rank == 3)
    assert layout.validate_layer_layout(16, None) is False
    assert repr(layout) == "--pipeline-stage-layers 4.5,4,4,3.5"
    with pytest.raises(ValueError, match="no stage layout of these layers: --pipeline-stage-layers 4.5/4/4/3.5 "
                                         "places 16 layers, --num-layers is 17"):
        layout.validate_layer_layout(17, None)


def _config(counts, pp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = {} if pp == 1 else {"pipeline_model_parallel_layout": stage_parts_layout(counts, pp)}
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, pipeline_model_parallel_size=pp,
                             pipeline_dtype=torch.float32, **layout)


def _gpt(config, layer_spec, pre: bool, post: bool):
    from megatron.core.models.gpt import GPTModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=128, max_sequence_length=16,
                        pre_process=pre, post_process=post)


def _layer_tensors(model) -> set[tuple[str, int]]:
    """(key, global layer) of every transformer-layer tensor the model would save; each under its
    module's own name in the stage (what a load restores it by: the layer's index in the block)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tensors = {name: t for name, t in model.sharded_state_dict().items()
               if isinstance(t, ShardedTensor) and t.key.startswith("decoder.layers.")}
    assert set(tensors) <= set(model.state_dict()), sorted(set(tensors) - set(model.state_dict()))
    return {(t.key, t.global_offset[0]) for t in tensors.values()}


def _at_stage(monkeypatch, parallel_state, rank: int) -> None:
    """This process is pipeline stage ``rank`` as far as megatron-core's layout asks (it passes no rank)."""
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: rank)


def test_parts_block_spec_cuts_each_layer_spec_to_its_part(parallel_state, monkeypatch) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    spec = get_gpt_layer_local_spec()
    config = _config((2.5, 1.5), 2)
    blocks = []
    for rank in (0, 1):
        _at_stage(monkeypatch, parallel_state, rank)
        blocks.append(parts_block_spec(config, spec, (2.5, 1.5), rank))
    first, second = blocks
    assert len(first.layer_specs) == 3 and len(second.layer_specs) == 2
    assert first.layer_specs[:2] == [spec, spec] and second.layer_specs[1] is spec  # whole layers untouched
    attention, mlp = first.layer_specs[2].submodules, second.layer_specs[0].submodules
    assert (attention.mlp, attention.pre_mlp_layernorm, attention.mlp_bda) == (IdentityOp, IdentityOp, IdentityFuncOp)
    assert attention.self_attention == spec.submodules.self_attention
    assert (mlp.self_attention, mlp.input_layernorm, mlp.self_attn_bda) == (IdentityOp, IdentityOp, IdentityFuncOp)
    assert mlp.mlp == spec.submodules.mlp
    assert first.submodules is spec.submodules  # BertModel reads the whole layer's attention spec here
    with pytest.raises(ValueError, match="stage 0 of --pipeline-stage-layers .* has 3 parts, the block spec 2 layers"):
        parts_block_spec(config, first.__class__(layer_specs=[spec, spec]), (2.5, 1.5), 0)


def test_half_layer_stages_save_the_whole_models_tensors_once(parallel_state, monkeypatch) -> None:
    """GPT stages of --pipeline-stage-layers 2.5,1.5 built by megatron-core: layer numbers from the
    layout's offsets, the split layer's attention on stage 0 and its MLP on stage 1 under its own
    global index; the two stages' layer tensors are the PP=1 model's, none twice."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec, counts = get_gpt_layer_local_spec(), (2.5, 1.5)
    whole = _layer_tensors(_gpt(_config(counts, 1), spec, True, True))
    config = _config(counts, 2)
    stages, saved = [], []
    for rank in (0, 1):
        _at_stage(monkeypatch, parallel_state, rank)
        stages.append(_gpt(config, parts_block_spec(config, spec, counts, rank), rank == 0, rank == 1))
        saved.append(_layer_tensors(stages[-1]))  # megatron asks the layout for the stage's offset here too
    first, second = (stage.decoder.layers for stage in stages)
    assert [layer.layer_number for layer in first] == [1, 2, 3] and [layer.layer_number for layer in second] == [3, 4]
    assert isinstance(first[2].mlp, IdentityOp) and not isinstance(first[2].self_attention, IdentityOp)
    assert isinstance(second[0].self_attention, IdentityOp) and not isinstance(second[0].mlp, IdentityOp)
    assert saved[0] | saved[1] == whole and not saved[0] & saved[1]
    assert {key for key, layer in saved[0] if layer == 2} == {key for key, _ in whole if key.startswith(
        "decoder.layers.self_attention.")}
    assert {key for key, layer in saved[1] if layer == 2} == {key for key, _ in whole if key.startswith(
        "decoder.layers.mlp.")}
