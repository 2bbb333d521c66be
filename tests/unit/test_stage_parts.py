"""trainer.schedule.stage_parts: --pipeline-stage-layers's placement (pure), and the configuration's checks
of the flag (trainer.config.parse_config)."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config, resolve_plan
from trainer.schedule.stage_parts import (
    LayerPart,
    describe,
    half_bounds,
    parse_stage_layers,
    parts_of_units,
    splits_inside_layers,
    stage_layers_problems,
    stage_offsets,
    stage_parts,
    whole_layers,
)

SPLIT = (4.5, 4, 4, 3.5)


def _layers(first: int, end: int) -> list[LayerPart]:
    return [LayerPart(i, "layer") for i in range(first, end)]


def test_parts_of_a_half_layer_split() -> None:
    """Stage 0 ends with layer 4's attention, stage 1 starts with its MLP; stage 2 ends with layer 12's
    attention; the last stage starts with its MLP."""
    assert stage_parts(SPLIT) == [
        [*_layers(0, 4), LayerPart(4, "attention")],
        [LayerPart(4, "mlp"), *_layers(5, 8), LayerPart(8, "attention")],
        [LayerPart(8, "mlp"), *_layers(9, 12), LayerPart(12, "attention")],
        [LayerPart(12, "mlp"), *_layers(13, 16)],
    ]
    assert half_bounds(SPLIT) == [0, 9, 17, 25, 32]
    assert stage_offsets(SPLIT) == [0, 4, 8, 12]  # a stage's first layer, even when it holds only its MLP
    assert whole_layers(SPLIT) == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 10, 11, 12], [12, 13, 14, 15]]
    assert splits_inside_layers(SPLIT) and describe(SPLIT) == "4.5/4/4/3.5"


def test_whole_counts_place_whole_layers() -> None:
    assert stage_parts((5, 4, 4, 3)) == [_layers(0, 5), _layers(5, 9), _layers(9, 13), _layers(13, 16)]
    assert stage_offsets((5, 4, 4, 3)) == [0, 5, 9, 13] and not splits_inside_layers((5, 4, 4, 3))
    assert describe((5, 4, 4, 3)) == "5/4/4/3"


def test_a_stage_of_one_half() -> None:
    """0.5: a stage holding only one layer's MLP (or attention) -- its layer numbers still start at
    that layer."""
    assert stage_parts((1.5, 1, 0.5, 1)) == [
        [LayerPart(0, "layer"), LayerPart(1, "attention")], [LayerPart(1, "mlp"), LayerPart(2, "attention")],
        [LayerPart(2, "mlp")], [LayerPart(3, "layer")]]
    assert stage_offsets((1.5, 1, 0.5, 1)) == [0, 1, 2, 3]
    assert parts_of_units(3, 4) == [LayerPart(1, "mlp")] and parts_of_units(4, 5) == [LayerPart(2, "attention")]


@pytest.mark.parametrize(("text", "counts"), [
    ("4.5,4,4,3.5", (4.5, 4, 4, 3.5)), ("4.5/4/4/3.5", (4.5, 4, 4, 3.5)), (" 5, 3 ", (5, 3)), ("4.0,4", (4, 4)),
])
def test_parse_stage_layers(text, counts) -> None:
    parsed = parse_stage_layers(text)
    assert parsed == counts
    assert all(type(c) is int for c in parsed if float(c).is_integer())  # 4, not 4.0, in every message


@pytest.mark.parametrize(("text", "entry"), [("4.5,x,4", "'x'"), ("4.5/4/", "''"), ("4,4;4", "'4;4'")])
def test_parse_stage_layers_names_the_bad_entry(text, entry) -> None:
    with pytest.raises(ValueError, match=f"--pipeline-stage-layers '{text}': {entry} is not a number"):
        parse_stage_layers(text)


@pytest.mark.parametrize(("args", "needles"), [
    ((16, 4, 1, SPLIT), []),
    ((16, 3, 1, SPLIT), ["--pipeline-stage-layers 4.5/4/4/3.5 gives 4 stages, --pipeline-model-parallel-size is 3"]),
    ((16, 4, 1, (4.5, 4, 4, 4.5)), ["--pipeline-stage-layers 4.5/4/4/4.5 places 17 layers, --num-layers is 16"]),
    ((16, 4, 1, (4.25, 4, 4, 3.75)), ["every stage needs a positive whole or half number of layers (not 4.25, 3.75)"]),
    ((16, 4, 1, (8, 0, 4, 4)), ["every stage needs a positive whole or half number of layers (not 0)"]),
    ((16, 4, 1, (9, -1, 4, 4)), ["(not -1)"]),
    ((16, 2, 2, SPLIT), []),  # one count per virtual stage: chunk 0 of stages 0, 1, then chunk 1
    ((16, 4, 2, SPLIT), ["--pipeline-stage-layers 4.5/4/4/3.5 gives 4 stages, 8 are needed: "
                         "--pipeline-model-parallel-size 4 x 2 virtual stages per rank, chunk 0 of every stage first"]),
    ((16, 2, 2, (4, 4, 9)), ["gives 3 stages, 4 are needed", "places 17 layers, --num-layers is 16"]),
])
def test_stage_layers_problems_name_every_bad_value(args, needles) -> None:
    problems = stage_layers_problems(*args)
    assert len(problems) == len(needles), problems
    for needle, problem in zip(needles, problems, strict=True):
        assert needle in problem


BASE = ["--mock-data", "--num-layers", "16", "--hidden-size", "64", "--num-attention-heads", "4",
        "--pipeline-model-parallel-size", "4", "--global-batch-size", "8", "--pipeline-stage-layers"]


def _problems(*argv: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config([*BASE, *argv], world_size=4)
    return err.value.problems


def test_the_flag_parses_into_the_parallel_section() -> None:
    assert parse_config([*BASE, "4.5/4/4/3.5"], world_size=4).parallel.pipeline_stage_layers == SPLIT


def test_the_flag_is_exclusive_with_megatrons_uneven_split() -> None:
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        assert any("--pipeline-stage-layers and --decoder-first/last-pipeline-num-layers: give one" in p
                   for p in _problems("4.5,4,4,3.5", flag, "5")), flag


def test_with_virtual_stages_the_flag_gives_every_virtual_stage() -> None:
    cfg = parse_config([*BASE, "2.5,2,2,2,2,2,2,1.5", "--num-virtual-stages-per-pipeline-rank", "2"], world_size=4)
    plan = resolve_plan(cfg, 4)
    assert plan.layers.per_stage == (4.5, 4, 4, 3.5) and plan.layers.describe() == "2.5/2/2/2/2/2/2/1.5"
    # chunk 0 of stage 0 holds layers 0, 1 and layer 2's attention; its chunk 1 (virtual stage 4, half units
    # 17-20) layer 8's MLP, layer 9 and layer 10's attention
    assert plan.layers.stage_layers()[0] == [[0, 1, 2], [8, 9, 10]]
    assert plan.layers.stage_layers()[1] == [[2, 3, 4], [10, 11, 12]]
    assert any("gives 4 stages, 8 are needed" in p
               for p in _problems("4.5,4,4,3.5", "--num-virtual-stages-per-pipeline-rank", "2"))
    assert any("--pipeline-stage-layers and --num-layers-per-virtual-pipeline-stage=2" in p
               for p in _problems("4.5,4,4,3.5", "--num-layers-per-virtual-pipeline-stage", "2"))


def test_the_flag_must_place_every_layer_on_every_stage() -> None:
    assert _problems("4.5,4,4,4.5") == ["--pipeline-stage-layers 4.5/4/4/4.5 places 17 layers, --num-layers is 16"]
    assert any("--pipeline-stage-layers 8/8 gives 2 stages, --pipeline-model-parallel-size is 4" in p
               for p in _problems("8,8"))


def test_a_bad_entry_is_named_on_the_command_line(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config([*BASE, "4.5,4,x,3.5"], world_size=4)
    assert "argument --pipeline-stage-layers: --pipeline-stage-layers '4.5,4,x,3.5': 'x' is not a number" in \
        capsys.readouterr().err
