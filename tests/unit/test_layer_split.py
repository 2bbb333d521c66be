"""trainer.schedule.layers: Megatron-LM's uneven first/last stage split, checked against megatron-core itself."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config
from trainer.schedule.layers import describe_split, layers_per_stage, split_problems, stage_layers

# (num_layers, pp, vp, first, last): even and uneven, with and without interleaving
LAYOUTS = [
    (16, 4, 1, None, None), (16, 4, 1, 5, 3), (16, 4, 1, 7, None), (16, 4, 1, None, 1),
    (8, 2, 1, 5, 3), (8, 2, 1, 3, None), (16, 4, 2, 6, 2), (20, 4, 2, None, 2), (12, 3, 2, 4, 2),
    (8, 4, 2, None, None), (24, 4, 2, 8, 4),
]


@pytest.mark.parametrize(("n", "pp", "vp", "first", "last"), LAYOUTS)
def test_stage_layers_equal_megatron_core_placement(n, pp, vp, first, last) -> None:
    """The global layer indices of every (stage, chunk) are those megatron-core's own offset and
    count functions give (what build.py gets when megatron builds the chunk)."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    assert split_problems(n, pp, vp, first, last) == []
    config = TransformerConfig(num_layers=n, hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                               pipeline_dtype=torch.float32, use_cpu_initialization=True)
    ours = stage_layers(n, pp, vp, first, last)
    for s in range(pp):
        for c in range(vp):
            vp_stage = c if vp > 1 else None
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=s)
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=s)
            assert ours[s][c] == list(range(offset, offset + count)), (s, c)
    assert sorted(i for stage in ours for chunk in stage for i in chunk) == list(range(n))


def test_describe_split_names_layers_per_stage() -> None:
    assert describe_split(16, 4, 5, 3) == "5/4/4/3"
    assert describe_split(16, 4) == "4/4/4/4"
    assert layers_per_stage(8, 2, None, 3) == [5, 3]


@pytest.mark.parametrize(("args", "needles"), [
    ((16, 4, 1, 5, 4), ["the 7 layers left after --decoder-first-pipeline-num-layers=5 + "
                        "--decoder-last-pipeline-num-layers=4 are not divisible by the 2 middle stages"]),
    ((8, 2, 1, 5, 4), ["is more than --num-layers=8"]),
    ((8, 2, 1, 5, 2), ["leaves 1 layers for 0 middle stages"]),
    ((16, 4, 2, 5, 3), ["--decoder-first-pipeline-num-layers=5 is not divisible by the 2 virtual stages",
                        "--decoder-last-pipeline-num-layers=3 is not divisible by the 2 virtual stages"]),
    ((16, 4, 2, 4, 2), ["5 layers per middle stage"]),
    ((8, 1, 1, 0, None), ["--decoder-first-pipeline-num-layers=0 must be >= 1", "need --pipeline-model-parallel-size > 1"]),
])
def test_split_problems_name_every_bad_value(args, needles) -> None:
    problems = split_problems(*args)
    assert len(problems) == len(needles), problems
    for needle, problem in zip(needles, problems, strict=True):
        assert needle in problem


BASE = ["--mock-data", "--num-layers", "16", "--hidden-size", "64", "--num-attention-heads", "4",
        "--pipeline-model-parallel-size", "4", "--global-batch-size", "8"]


def test_uneven_flags_and_p2p_switches_parse() -> None:
    cfg = parse_config(BASE + ["--decoder-first-pipeline-num-layers", "5", "--decoder-last-pipeline-num-layers",
                               "3", "--no-batch-p2p-sync"], world_size=4)
    assert cfg.parallel.decoder_first_pipeline_num_layers == 5 and cfg.parallel.decoder_last_pipeline_num_layers == 3
    assert cfg.uneven_pipeline and not cfg.parallel.batch_p2p_sync and cfg.parallel.overlap_p2p_comm
    assert cfg.virtual_pipeline == 1
    vp = parse_config(BASE + ["--decoder-first-pipeline-num-layers", "6", "--decoder-last-pipeline-num-layers", "2",
                              "--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication"],
                      world_size=4)
    assert vp.virtual_pipeline == 2 and not vp.parallel.overlap_p2p_comm
    even = parse_config(BASE + ["--num-virtual-stages-per-pipeline-rank", "2"], world_size=4)
    assert even.virtual_pipeline == 2 and not even.uneven_pipeline


def test_uneven_layout_errors_arrive_in_one_message() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--decoder-first-pipeline-num-layers", "5", "--decoder-last-pipeline-num-layers", "4",
                             "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "3"], world_size=4)
    text = str(err.value)
    # field problem first (layout checks need valid sections), so fix it and look again
    assert "give --num-virtual-stages-per-pipeline-rank instead" in text
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--decoder-first-pipeline-num-layers", "5", "--decoder-last-pipeline-num-layers", "4",
                             "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "3"], world_size=4)
    problems = err.value.problems
    for needle in ("--decoder-first-pipeline-num-layers=5 is not divisible by the 2 virtual stages",
                   "the 7 layers left after", "--global-batch-size=8 is not divisible by --micro-batch-size=3"):
        assert any(needle in p for p in problems), (needle, problems)


def test_vp_without_overlap_on_two_stages_is_refused_for_megatron_schedules() -> None:
    flags = ["--mock-data", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
             "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
             "--global-batch-size", "8", "--no-overlap-p2p-communication"]
    with pytest.raises(ConfigError, match="needs --pipeline-model-parallel-size > 2"):
        parse_config(flags, world_size=2)
    assert parse_config(flags + ["--use-dpp"], world_size=2).virtual_pipeline == 2
