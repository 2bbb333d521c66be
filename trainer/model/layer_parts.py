"""megatron-core stages under ``--pipeline-stage-layers``: any count per stage, half layers included.

megatron-core places layers itself from ``TransformerConfig``: ``get_num_layers_to_build`` gives a
stage's count and ``get_transformer_layer_offset`` its first layer's global index (the block numbers
its layers ``offset + i + 1`` and keys checkpoints by it). Both ask the config's
``pipeline_model_parallel_layout`` first, so :class:`StagePartsLayout` -- megatron's own layout
class, built with one ``decoder`` entry per part -- answers with trainer.schedule.stage_parts's
placement: the offset of a stage that starts with a layer's MLP half is that layer's index, not the
count of parts before it. Each part is built from the model's layer spec, the other half's modules
replaced by megatron's ``IdentityOp`` / ``IdentityFuncOp`` (scripts/layer_halves_probe.py: the halves
compose to the whole layer exactly and give its checkpoint keys).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trainer.problems import raise_if_any
from trainer.schedule.stage_parts import LayerPart, stage_layers_problems, stage_offsets, stage_parts


def stage_parts_layout(counts: Sequence[float], pp: int):
    """megatron-core's layout object for ``counts`` layers per virtual stage (--pipeline-stage-layers:
    chunk 0 of every stage, then chunk 1...; megatron-core's own order of a layout's rows)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    class StagePartsLayout(PipelineParallelLayerLayout):
        """One ``decoder`` entry per part of each virtual stage; offsets by layer, not by part."""

        def __init__(self) -> None:
            self.counts = tuple(counts)
            self.parts = stage_parts(counts)
            self.offsets = stage_offsets(counts)
            last = len(counts) - 1
            rows = [(["embedding"] if k == 0 else []) + ["decoder"] * len(self.parts[k])
                    + (["loss"] if k == last else []) for k in range(len(counts))]
            super().__init__(rows, pp)

        def __repr__(self) -> str:
            return f"--pipeline-stage-layers {','.join(map(str, self.counts))}"

        def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None):
            problems = stage_layers_problems(num_layers, pp, self.virtual_pipeline_model_parallel_size, self.counts)
            if mtp_num_layers:
                problems.append("--pipeline-stage-layers does not place multi-token-prediction layers")
            raise_if_any(problems, "no stage layout of these layers")
            return False  # no standalone MTP stage

        def get_layer_offset(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None):
            if layer_type != LayerType.decoder:
                return super().get_layer_offset(layer_type=layer_type, vp_stage=vp_stage, pp_rank=pp_rank)
            if pp_rank is None:
                pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            return self.offsets[(vp_stage or 0) * pp + pp_rank]

    return StagePartsLayout()


def part_spec(layer_spec, part: LayerPart):
    """``layer_spec`` holding only ``part`` of its layer (itself for a whole layer)."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    if part.part == "layer":
        return layer_spec
    sub = layer_spec.submodules
    if part.part == "attention":
        sub = dataclasses.replace(sub, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    else:
        sub = dataclasses.replace(sub, input_layernorm=IdentityOp, self_attention=IdentityOp,
                                  self_attn_bda=IdentityFuncOp)
    return dataclasses.replace(layer_spec, submodules=sub)


def parts_block_spec(config, spec, counts: Sequence[float], virtual_stage: int, vp_stage: int | None = None):
    """The block spec of ``virtual_stage`` (chunk c of stage s is ``c * pp + s``): megatron's own block
    submodules for ``spec`` (a layer spec or a block spec; ``vp_stage``: the chunk, as megatron asks
    it), each layer spec cut to its part.

    It also answers ``.submodules`` with the whole layer's submodules: BertModel reads its attention
    spec there (the attention-mask layout, and under Transformer Engine it sets the mask type on it,
    an object every part's spec shares) before it hands the spec to its block."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, _get_block_submodules

    @dataclasses.dataclass
    class PartsBlockSubmodules(TransformerBlockSubmodules):
        submodules: object = None

    block = _get_block_submodules(config, spec, vp_stage)
    parts = stage_parts(counts)[virtual_stage]
    if len(block.layer_specs) != len(parts):
        raise ValueError(f"virtual stage {virtual_stage} of --pipeline-stage-layers {counts} has {len(parts)} parts, "
                         f"the block spec {len(block.layer_specs)} layers")
    return PartsBlockSubmodules(layer_specs=[part_spec(s, p) for s, p in zip(block.layer_specs, parts, strict=True)],
                                layer_norm=block.layer_norm, submodules=block.layer_specs[0].submodules)
