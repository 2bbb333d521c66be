"""A benchmark layout naming its own model (``--layouts 4x1x1@bert16-h2048``): the layouts experiment
measures BERT at PP=4 in the same call as the GPT layouts, one table per layout, each naming its model
(no runs: the parser, the planned command lines through the trainer's own configuration checks, and
the report from given figures; the CPU run itself: ``python -m trainer.bench.run layouts --device cpu``)."""

from __future__ import annotations

import datetime
import re
import shlex
from pathlib import Path

import pytest

from trainer.bench.experiments import EXPERIMENTS, MODELS
from trainer.bench.layouts import parse_layouts
from trainer.bench.run import header, layouts_for, tool_command
from trainer.config import parse_config, resolve_plan

SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def test_a_layout_names_its_model_and_its_label_stays_a_safe_file_name() -> None:
    layouts, problems = parse_layouts("4x1x1,4x1x1@bert16-h2048,2x1x2+overlap+distopt@tiny-bert")
    assert problems == []
    assert [lay.model for lay in layouts] == ["", "bert16-h2048", "tiny-bert"]
    assert [lay.label for lay in layouts] == ["pp4xtp1xdp1", "pp4xtp1xdp1-bert16-h2048",
                                              "pp2xtp1xdp2+overlap+distopt-tiny-bert"]
    # the timelines' names: the line key with "+" spelt "-" (trainer.bench.pipeline._picture)
    for lay in layouts:
        assert SAFE_FILE_NAME.match(f"r.timeline-{lay.label}-a-dpp-default.png".replace("+", "-")), lay.label


@pytest.mark.parametrize(("text", "problem"), [
    ("4x1x1@bart", "--layouts: '4x1x1@bart': unknown model 'bart' (known: gpt16-h2048"),
    ("2x2x1+sp@bert16-h2048", "+sp (--sequence-parallel) is implemented for GPT only; bert16-h2048 is BERT"),
    ("4x1x1@bert16-h2048,4x1x1@bert16-h2048", "--layouts: pp4xtp1xdp1-bert16-h2048 given twice"),
    ("4x1x1@", "is not PPxTPxDP[+sp][+overlap][+distopt][@MODEL]"),
])
def test_a_layouts_model_is_refused_by_name_before_any_line_starts(text: str, problem: str) -> None:
    layouts, problems = parse_layouts(text)
    assert any(problem in p for p in problems), problems
    assert parse_layouts("4x1x1,4x1x1@bert16-h2048")[1] == []  # the same PP on two models: two tables


def test_bert_is_the_gpt_benchmark_models_size_class_within_its_position_table() -> None:
    bert, gpt = MODELS["bert16-h2048"], MODELS["gpt16-h2048"]
    assert bert.model == "bert" and MODELS[bert.cpu_stand_in].model == "bert"
    assert (bert.num_layers, bert.hidden_size, bert.num_attention_heads, bert.num_microbatches) == \
        (gpt.num_layers, gpt.hidden_size, gpt.num_attention_heads, gpt.num_microbatches)
    assert bert.seq_length == 512  # BERT's absolute position table
    assert bert.seq_length * bert.micro_batch_size == gpt.seq_length * gpt.micro_batch_size  # tokens per microbatch
    assert "BERT 16 layers, hidden 2048" in bert.describe() and MODELS["gpt16-h2048"].describe().startswith("GPT ")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_models_flags_give_the_tool_exactly_its_fields(name: str) -> None:
    """The model's flags (``bench_args``, what the call's model passes) and its fields (``bench_fields``,
    what a layout naming it replaces) are one description: parsed by the tool they agree."""
    from trainer.bench.pipeline import _config, build_parser

    args = build_parser().parse_args([*MODELS[name].bench_args(), "--out", "o", "--report", "r.md"])
    cfg = _config(args)
    assert {k: getattr(cfg, k) for k in MODELS[name].bench_fields()} == MODELS[name].bench_fields()


def _planned(capsys, argv: list[str]) -> dict[str, list[str]]:
    from trainer.bench.pipeline import main as pipeline_main

    assert pipeline_main(argv[3:] + ["--dry-plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    return {ln.split(": ", 1)[0]: shlex.split(ln.split(": ", 1)[1])[3:] for ln in out if ": python -m " in ln}


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_layouts_experiment_plans_bert_pp4_beside_the_gpt_layouts(device: str, tmp_path: Path, capsys) -> None:
    """One call: every layout's two lines, BERT's on its own model (tiny-bert standing in on CPU), each
    command accepted by the trainer's configuration checks at its layout's world size."""
    exp = EXPERIMENTS["layouts"]
    assert "4x1x1@bert16-h2048" in exp.layouts
    model = exp.cpu_model if device == "cpu" else exp.model
    argv, _ = tool_command(exp, device, 4, model, "", tmp_path, tmp_path / "r.md", [])
    commands = _planned(capsys, argv)
    bert_name = "tiny-bert" if device == "cpu" else "bert16-h2048"
    bert_keys = {f"pp4xtp1xdp1-{bert_name}-a-{line}" for line in exp.lines}
    assert len(commands) == len(exp.layouts) * len(exp.lines) and bert_keys <= set(commands), sorted(commands)
    for key, args in commands.items():
        world = {"pp4": 4, "pp2": 4}[key[:3]]
        cfg = parse_config(args, world_size=world)  # raises ConfigError naming any refused flag
        bert = key in bert_keys
        assert cfg.model.model == ("bert" if bert else "gpt"), key
        sizes = MODELS[bert_name if bert else model]
        assert (cfg.model.seq_length, cfg.model.max_positions, cfg.optim.micro_batch_size) == \
            (sizes.seq_length, sizes.seq_length, sizes.micro_batch_size), key
    if device == "cuda":
        bert = MODELS["bert16-h2048"]
        default = commands["pp4xtp1xdp1-bert16-h2048-a-dpp-default"]
        assert _value(default, "--seq-length") == "512" and _value(default, "--global-batch-size") == "128"
        assert "--decoder-first-pipeline-num-layers" not in default  # head weight 1: the even 4/4/4/4
        assert bert.head_weight == 1.0


def test_use_dpp_alone_on_bert_pp4_resolves_to_graphed_dpp_zb(tmp_path: Path, capsys) -> None:
    """The BERT line's default command on CUDA: CUDA graphs and dpp-zb, as on GPT; its megatron line runs
    megatron-core's own 1F1B."""
    exp = EXPERIMENTS["layouts"]
    argv, _ = tool_command(exp, "cuda", 4, exp.model, "", tmp_path, tmp_path / "r.md", [])
    commands = _planned(capsys, argv)
    default = resolve_plan(parse_config(commands["pp4xtp1xdp1-bert16-h2048-a-dpp-default"], world_size=4), 4)
    schedule = default.schedule
    assert (schedule.engine, schedule.policy, schedule.cuda_graphs, schedule.split_backward) == \
        ("runtime", "dpp-zb", True, True), schedule.log_text
    megatron = resolve_plan(parse_config(commands["pp4xtp1xdp1-bert16-h2048-a-megatron-1f1b-best"], world_size=4), 4)
    assert (megatron.schedule.engine, megatron.schedule.policy) == ("megatron-core", "1f1b")
    assert default.layers.per_stage == megatron.layers.per_stage == (4, 4, 4, 4)


def test_the_result_files_header_names_the_bert_layouts_model(tmp_path: Path) -> None:
    exp = EXPERIMENTS["layouts"]
    when = datetime.datetime(2026, 11, 28, 3, 50, tzinfo=datetime.UTC)
    text = "\n".join(header(exp, when, "4 x H200", {}, "abc", exp.model, 4, "cmd", "tool", [], None,
                            layouts_for(exp, "cuda")))
    assert "layouts 4x1x1, 2x2x1+sp, 2x1x2+overlap+distopt, 4x1x1@bert16-h2048" in text
    assert "@bert16-h2048: model **bert16-h2048** (BERT 16 layers, hidden 2048, 16 heads, seq 512" in text
    assert layouts_for(exp, "cpu")[-1] == "4x1x1@tiny-bert"


def test_each_layouts_table_names_its_model(tmp_path: Path) -> None:
    import dataclasses

    from trainer.bench.lines import BenchConfig
    from trainer.bench.report import write_report
    from trainer.bench.results import LineResult

    gpt_layout, bert_layout = parse_layouts("4x1x1,4x1x1@bert16-h2048")[0]
    gpt = BenchConfig(layout=gpt_layout, model_flags=("--transformer-impl", "local"))
    bert = dataclasses.replace(gpt, layout=bert_layout, **MODELS["bert16-h2048"].bench_fields())
    results, layouts = [], {}
    for lay in (gpt_layout, bert_layout):
        for name, ms in (("megatron-1f1b-best", 800.0), ("dpp-default", 500.0)):
            key = f"{lay.label}-a-{name}"
            results.append(LineResult(key, name, "a", name, timed_ms=[ms], round_medians=[ms], reserved_gib=10.0))
            layouts[key] = lay.label
    report = tmp_path / "r.md"
    write_report(report, gpt, results, [], {}, {}, 1.0, layouts=layouts,
                 configs={gpt_layout.label: gpt, bert_layout.label: bert})
    text = report.read_text()
    assert "Model: per layout (each layout's section names it)" in text
    gpt_section = text[text.index("## Layout pp4xtp1xdp1\n"):text.index("## Layout pp4xtp1xdp1-bert16-h2048")]
    bert_section = text[text.index("## Layout pp4xtp1xdp1-bert16-h2048"):]
    assert "Model: GPT 16 layers, hidden 2048, 16 heads, seq 1024" in gpt_section and "BERT" not in gpt_section
    assert "Model: **bert16-h2048**: BERT 16 layers, hidden 2048, 16 heads, seq 512, vocab 30522" in bert_section
    assert "1.600x" in bert_section  # its own ratio, against its own megatron line


def test_bert_layouts_list_the_corpus_scenario_as_not_run_with_the_reason() -> None:
    """Scenario (d)'s corpus is GPT-2-tokenized: a BERT layout's lines are listed as not run, not failed."""
    import dataclasses

    from trainer.bench.lines import BenchConfig, Line, NotRun, plan
    from trainer.config import DPP_POLICIES

    layout = parse_layouts("4x1x1@bert16-h2048")[0][0]
    cfg = dataclasses.replace(BenchConfig(corpus="c", layout=layout), **MODELS["bert16-h2048"].bench_fields())
    planned = plan(cfg, ["megatron-1f1b-best", "dpp-default"], ["a", "d"], DPP_POLICIES)
    assert [type(p) for p in planned] == [Line, Line, NotRun, NotRun]
    assert "--model bert needs a WordPiece one" in planned[2].reason and planned[2].layout == layout.label
