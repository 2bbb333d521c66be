"""The benchmark's graphed static bars, its three-ratio headline, --layouts and --resplit auto (no runs:
the report from given figures, the plan's command lines, and the split chosen from a profiling round's
figures handed in by a stand-in for the run)."""

from __future__ import annotations

import dataclasses

import pytest

from trainer.bench.layouts import Layout, parse_layouts
from trainer.bench.lines import BenchConfig, Line, NotRun, plan
from trainer.bench.report import balanced_limit_ms, headline, write_report
from trainer.bench.resplit import choose_splits
from trainer.bench.results import LineResult
from trainer.config import DPP_POLICIES, parse_config


def _line(name: str, ms: float, gib: float | None, busy: tuple[float, ...] = (), scenario: str = "a") -> LineResult:
    return LineResult(f"{scenario}-{name}", name, scenario, name, timed_ms=[ms], round_medians=[ms], reserved_gib=gib,
                      busy_ms=dict(enumerate(busy)), busy_source="GPU kernels (torch.profiler)" if busy else "")


def test_headline_states_the_three_ratios_of_the_fastest_dpp_line_within_memory() -> None:
    # figures like the 4 x H100 measurement's: megatron 810.7 eager, dpp-zb-graphs 474.0 at 1.155x (over the bound),
    # dpp-zb-graphs-rs2 511.5 at 1.037x; the graphed static 1F1B 490 ms; busy 449/346/346/395.
    results = [_line("megatron-1f1b-best", 810.7, 11.67, (452, 345, 345, 394)),
               _line("dpp-zb-graphs", 474.0, 13.48, (449, 346, 346, 395)),
               _line("dpp-zb-graphs-rs2", 511.5, 12.10, (486, 346, 346, 395)),
               _line("1f1b-graphs", 490.0, 13.48, (450, 345, 345, 394)),
               _line("zb-h1-graphs", 500.0, 14.9, (451, 347, 347, 396)),
               _line("1f1b-eager", 800.0, 11.7)]
    text = "\n".join(headline(results, "a"))
    assert "**dpp-zb-graphs-rs2** (fastest within 1.10x megatron-1f1b-best's peak reserved)" in text
    assert "vs megatron-core's best eager line (megatron-1f1b-best, 810.7 ms): **1.585x**" in text
    # the second bar is the best *graphed* static line, not the eager one
    assert "best graphed static order in the same runtime (1f1b-graphs, 490.0 ms): **0.958x**" in text
    assert f"= {(486 + 346 + 346 + 395) / 4:.1f} ms" in text and f"**{511.5 / ((486 + 346 + 346 + 395) / 4):.3f}x**" in text
    assert "the static bar's: " in text
    # what no order beats: the busiest stage's GPU time, the headline line's and the static bar's
    assert (f"Step vs its slowest stage's busy (stage 0, 486.0 ms: no order of the same kernels runs faster): "
            f"{511.5 / 486:.3f}x; the static bar's: {490 / 450:.3f}x (the most a better order could gain over it).") in text
    v2 = [_line("interleaved-graphs", 520.0, 12.0, (500, 470, 470, 480)), _line("dpp-graphs-v2", 480.0, 20.0),
          _line("dpp-graphs-v2-parity", 495.0, 13.0)]
    text = "\n".join(headline(results + v2, "a"))
    assert ("- v=2: **dpp-graphs-v2-parity** vs interleaved-graphs: **1.051x** at 1.083x its peak reserved "
            "(interleaved-graphs's step is 1.040x its slowest stage's busy: the most a better order could gain over it).") in text
    assert balanced_limit_ms(results[0]) == pytest.approx((452 + 345 + 345 + 394) / 4)


def test_megatron_cores_own_graphs_are_a_graphed_static_bar_not_its_eager_one() -> None:
    # figures of the Transformer Engine measurement (2 x H200, PP=2): megatron-core eager 1269.3, with its own
    # graphs 498.4, the DPP default 483.6
    results = [_line("megatron-1f1b-best", 1269.3, 10.18, (430, 437)), _line("megatron-1f1b-graphs", 498.4, 10.76, (432, 451)),
               _line("dpp", 1168.3, 10.24, (431, 441)), _line("dpp-default", 483.6, 10.45, (431, 455))]
    text = "\n".join(headline(results, "a"))
    assert "vs megatron-core's best eager line (megatron-1f1b-best, 1269.3 ms): **2.625x**" in text
    assert ("best graphed static order megatron-core's schedule with its own graphs (megatron-1f1b-graphs, 498.4 ms): "
            "**1.031x**") in text


def test_headline_falls_back_to_an_eager_static_line_and_says_so() -> None:
    results = [_line("megatron-1f1b-best", 100.0, None, (40, 30)), _line("dpp", 90.0, None, (40, 30)),
               _line("zb-h1-eager", 95.0, None), _line("1f1b-eager", 99.0, None)]
    text = "\n".join(headline(results, "a"))
    assert "**dpp** (fastest DPP line (memory not compared))" in text
    assert "static (eager: no graphed static line ran, e.g. on CPU) order in the same runtime (zb-h1-eager" in text
    assert "**1.056x**" in text
    assert headline([_line("megatron-1f1b-best", 1.0, None)], "a") == []  # no DPP line: no headline


def test_static_lines_plan_their_policy_with_graphs_and_are_not_dynamic_in_the_verdict(tmp_path) -> None:
    cfg = BenchConfig(num_microbatches=32, pipeline_parallel=4)
    planned = plan(cfg, ["1f1b-graphs", "interleaved-graphs", "zb-h1-graphs", "zb-h1-graphs-q0"], ["a"],
                   DPP_POLICIES)
    lines = {p.name: p for p in planned if isinstance(p, Line)}
    assert set(lines) == {"1f1b-graphs", "interleaved-graphs", "zb-h1-graphs", "zb-h1-graphs-q0"}
    for name, policy in (("1f1b-graphs", "1f1b"), ("interleaved-graphs", "interleaved"), ("zb-h1-graphs", "zb-h1")):
        args = lines[name].args
        assert args[args.index("--dpp-policy") + 1] == policy and "--dpp-cuda-graphs" in args
    assert lines["interleaved-graphs"].args[lines["interleaved-graphs"].args.index(
        "--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert lines["zb-h1-graphs-q0"].args[-lines["zb-h1-graphs-q0"].args[::-1].index("--dpp-max-queued-ops")] == "0"
    # every planned static line is a configuration the trainer accepts (on CUDA)
    for line in lines.values():
        argv = line.args[line.args.index("--mock-data"):]
        parse_config(argv + ["--device", "cuda"], world_size=4)
    # CPU: graphs are listed as not run, with the reason; M not divisible by PP refuses the interleaved order
    cpu = plan(BenchConfig(device="cpu", num_microbatches=6, pipeline_parallel=4), ["1f1b-graphs", "interleaved-eager"],
               ["a"], DPP_POLICIES)
    reasons = {p.name: p.reason for p in cpu if isinstance(p, NotRun)}
    assert reasons == {"1f1b-graphs": "CUDA graphs need CUDA",
                       "interleaved-eager": "the interleaved 1F1B order needs M (6) divisible by PP"}
    # In the verdict (fastest DPP line within memory) a static line never stands for DPP.
    report = tmp_path / "r.md"
    write_report(report, BenchConfig(device="cpu"), [_line("megatron-1f1b-best", 500, 10.0),
                                                      _line("1f1b-graphs", 400, 10.5), _line("dpp", 450, 10.5)],
                 [], {}, {}, 1.0)
    assert "fastest DPP line within 1.10x megatron-1f1b-best's memory: **dpp**" in report.read_text()


def test_layouts_parse_and_refuse_what_cannot_mean_anything() -> None:
    layouts, problems = parse_layouts("4x1x1, 2x2x1+sp,2x1x2+overlap+distopt")
    assert problems == []
    assert [lay.label for lay in layouts] == ["pp4xtp1xdp1", "pp2xtp2xdp1+sp", "pp2xtp1xdp2+overlap+distopt"]
    assert [lay.world_size for lay in layouts] == [4, 4, 4]
    assert layouts[2].trainer_args() == ["--overlap-grad-reduce", "--use-distributed-optimizer"]
    assert layouts[1].trainer_args() == ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    _, problems = parse_layouts("2x1x1+sp,4x1,2x1x1+overlap,1x2x2,2x1x2+fast,2x1x1,2x1x1")
    text = "\n".join(problems)
    assert "'2x1x1+sp': +sp (--sequence-parallel) needs TP > 1" in text
    assert "'4x1' is not PPxTPxDP" in text
    assert "'2x1x1+overlap': +overlap (--overlap-grad-reduce) needs DP > 1" in text
    assert "'1x2x2': the benchmark compares pipeline schedules: PP must be >= 2" in text
    assert "unknown option(s) fast" in text and "pp2xtp1xdp1 given twice" in text


def test_a_layout_plans_its_ranks_batch_and_flags_per_line(tmp_path) -> None:
    lay = Layout(2, 1, 2, ("overlap", "distopt"))
    cfg = BenchConfig(device="cpu", num_microbatches=4, micro_batch_size=2, pipeline_parallel=2, layout=lay)
    planned = plan(cfg, ["megatron-1f1b-best", "dpp-default", "direct-megatron"], ["a"], DPP_POLICIES)
    lines = [p for p in planned if isinstance(p, Line)]
    assert [ln.key for ln in lines] == ["pp2xtp1xdp2+overlap+distopt-a-megatron-1f1b-best",
                                        "pp2xtp1xdp2+overlap+distopt-a-dpp-default"]
    for ln in lines:
        assert ln.world_size == 4 and ln.layout == lay.label
        assert ln.args[ln.args.index("--global-batch-size") + 1] == "16"  # M x mbs x DP
        assert "--overlap-grad-reduce" in ln.args and "--use-distributed-optimizer" in ln.args
    [skipped] = [p for p in planned if isinstance(p, NotRun)]
    assert skipped.layout == lay.label and "TP = DP = 1" in skipped.reason
    # One table per layout in the report.
    other = Layout(2, 2, 1, ("sp",))
    results = [_line("megatron-1f1b-best", 100, None), _line("dpp-default", 90, None)]
    for r in results:
        r.key = f"{lay.label}-{r.key}"
    second = [_line("megatron-1f1b-best", 200, None), _line("dpp-default", 210, None)]
    for r in second:
        r.key = f"{other.label}-{r.key}"
    report = tmp_path / "r.md"
    write_report(report, cfg, results + second, [skipped], {}, {}, 1.0,
                 layouts={r.key: (lay if r in results else other).label for r in results + second})
    text = report.read_text()
    first, rest = text.split(f"## Layout {lay.label}")[1].split(f"## Layout {other.label}")
    assert "| dpp-default |" in first and "1.111x" in first
    assert "| dpp-default |" in rest and "0.952x" in rest
    assert "[pp2xtp1xdp2+overlap+distopt]: trainer.bench.direct drives a pipeline only" in text


def test_resplit_runs_a_short_round_and_takes_the_fits_split() -> None:
    cfg = BenchConfig(device="cpu", num_layers=16, pipeline_parallel=4, num_microbatches=8, train_iters=10)
    ran: list[tuple[str, int, list[str]]] = []

    def run(line: Line, short: BenchConfig) -> LineResult:
        ran.append((line.name, short.train_iters, line.args))
        result = _line(line.name, 100.0, None)
        # stage 0 persistently slow: 5/4/4/3 split measured 130/100/100/100 ms (the last stage's head ~1 layer)
        result.busy_rows = [[130.0, 100.0, 100.0, 100.0]] * 4
        result.layers_per_stage = [5, 4, 4, 3]
        return result

    # the first listed line of the chunk count that can run here (graphs cannot on CPU)
    chosen, choices = choose_splits(cfg, ["1f1b-graphs", "megatron-1f1b-best", "dpp"], DPP_POLICIES, run)
    assert [r[0] for r in ran] == ["resplit-megatron-1f1b-best"]
    assert ran[0][1] == cfg.skip_iters + 3 + cfg.gpu_busy_iters  # a short round
    [choice] = choices
    # Fitted: layer 25, embedding 5, head 25 ms. Megatron's best (4/4/4/4) leaves the last stage at 125 ms;
    # half layers (the attention half 0.36 of a layer by the model's FLOPs) bring the slowest to 116 ms.
    assert choice.vp == 1 and chosen.split is None and chosen.pipeline_stage_layers == choice.stage_layers
    assert choice.stage_layers == "4,4,4.5,3.5"
    assert "ran the --pipeline-stage-layers 4,4,4.5,3.5: the stage-balance fit's re-split of 5/4/4/3 in half" \
        in choice.note()
    assert "116.0 ms predicted against 125.0 ms for the best split Megatron's" in choice.note()
    assert "0.360 of a layer (by the model's FLOPs (not on CUDA))" in choice.note()
    lines = plan(chosen, ["megatron-1f1b-best", "dpp-v2"], ["a"], DPP_POLICIES)
    assert lines[0].args[lines[0].args.index("--pipeline-stage-layers") + 1] == "4,4,4.5,3.5"
    assert "--decoder-first-pipeline-num-layers" not in lines[0].args
    assert "--pipeline-stage-layers" not in lines[1].args  # v=2 keeps whole layers
    assert parse_config(lines[0].args, world_size=4).parallel.pipeline_stage_layers == (4, 4, 4.5, 3.5)
    # A measured share moves the split; where Megatron's flags balance as well, they are kept.
    shared, [choice] = choose_splits(dataclasses.replace(cfg, attention_share=0.5), ["dpp"],
                                     DPP_POLICIES, run)
    assert "0.500 of a layer (--attention-share)" in choice.note() and shared.pipeline_stage_layers

    def whole(line: Line, short: BenchConfig) -> LineResult:
        result = _line(line.name, 100.0, None)
        # layer 25, embedding 25, head 50 ms: 3/5/5/3 puts every stage at 125 ms, the mean
        result.busy_rows, result.layers_per_stage = [[150.0, 100.0, 100.0, 125.0]] * 4, [5, 4, 4, 3]
        return result

    flags, [choice] = choose_splits(cfg, ["dpp"], DPP_POLICIES, whole)
    assert flags.split == choice.split == (3, 3) and not flags.pipeline_stage_layers
    assert "--decoder-first/last-pipeline-num-layers 3/3" in choice.note()
    # A given split is kept without a round; a balanced run keeps its split and says why.
    kept, choices = choose_splits(BenchConfig(device="cpu", split=(5, 3)), ["dpp"], DPP_POLICIES, run)
    assert kept.split == (5, 3) and "given (--split)" in choices[0].reason and len(ran) == 2
    kept, [choice] = choose_splits(BenchConfig(device="cpu", pipeline_stage_layers="4.5,4,4,3.5"), ["dpp"],
                                   DPP_POLICIES, run)
    assert kept.pipeline_stage_layers == "4.5,4,4,3.5" and "given (--pipeline-stage-layers)" in choice.note()
    assert len(ran) == 2

    def balanced(line: Line, short: BenchConfig) -> LineResult:
        result = _line(line.name, 100.0, None)
        result.busy_rows, result.layers_per_stage = [[100.0, 100.0, 100.0, 100.0]] * 4, [5, 4, 4, 3]
        return result

    kept, choices = choose_splits(cfg, ["dpp"], DPP_POLICIES, balanced)
    assert kept.split is None and "recommends no re-split" in choices[0].reason


def test_resplit_gives_the_v2_lines_a_count_per_virtual_stage() -> None:
    """With whole layers megatron-core gives both chunks of a stage the same count: the v=2 lines' best
    split keeps the head on the last stage. The fit of their round places half layers per virtual stage."""
    cfg = BenchConfig(device="cpu", num_layers=16, pipeline_parallel=4, num_microbatches=8, train_iters=10)

    def run(line: Line, short: BenchConfig) -> LineResult:
        result = _line(line.name, 100.0, None)
        # 4/4/4/4 measured 105/100/100/150 ms: layer 25, embedding 5, head 50 ms
        result.busy_rows, result.layers_per_stage = [[105.0, 100.0, 100.0, 150.0]] * 4, [4, 4, 4, 4]
        return result

    chosen, [choice] = choose_splits(cfg, ["megatron-interleaved-v2", "dpp-v2"], DPP_POLICIES, run)
    assert choice.vp == 2 and chosen.split_vp is None and not chosen.pipeline_stage_layers
    assert chosen.pipeline_stage_layers_vp == choice.stage_layers == "2,2,2,2,2.5,2.5,2.5,0.5"
    assert "half layers per virtual stage" in choice.note() and "116.0 ms predicted against 150.0 ms" in choice.note()
    lines = plan(chosen, ["megatron-interleaved-v2", "dpp-v2", "dpp"], ["a"], DPP_POLICIES)
    assert [ln.args[ln.args.index("--pipeline-stage-layers") + 1] if "--pipeline-stage-layers" in ln.args else None
            for ln in lines] == ["2,2,2,2,2.5,2.5,2.5,0.5"] * 2 + [None]  # the v=1 line keeps its split
    assert parse_config(lines[1].args, world_size=4).parallel.pipeline_stage_layers == (2, 2, 2, 2, 2.5, 2.5, 2.5, 0.5)
    kept, [choice] = choose_splits(dataclasses.replace(cfg, pipeline_stage_layers_vp="2,2,2,2,2,2,2,2"), ["dpp-v2"],
                                   DPP_POLICIES, run)
    assert kept.pipeline_stage_layers_vp == "2,2,2,2,2,2,2,2" and "given (--pipeline-stage-layers-vp)" in choice.note()


def test_the_v2_parity_line_recomputes_enough_slots_to_match_the_interleaved_orders_memory() -> None:
    from trainer.bench.lines import parity_recompute_slots

    # PP=4, M=32: the dynamic cap 11/9/7/5 in each of 2 chunks against interleaved's 8+4/8+4/7+3/5+1 slots
    assert parity_recompute_slots(4, 32) == (10, 6, 4, 4)
    assert parity_recompute_slots(2, 32) == (4, 2)
    [line] = plan(BenchConfig(num_microbatches=32, pipeline_parallel=4), ["dpp-graphs-v2-parity"], ["a"], DPP_POLICIES)
    assert line.args[line.args.index("--dpp-recompute-slots") + 1] == "10,6,4,4"
    parse_config(line.args[line.args.index("--mock-data"):], world_size=4)


def test_given_stage_layers_reach_the_v1_lines_and_bad_ones_are_refused(capsys) -> None:
    from trainer.bench.pipeline import main as pipeline_main

    tiny = ["--device", "cpu", "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "128", "--pipeline-parallel", "4", "--num-microbatches", "4",
            "--lines", "dpp,dpp-v2", "--scenarios", "a", "--out", "o", "--report", "r.md"]
    assert pipeline_main([*tiny, "--pipeline-stage-layers", "2.5,2,2,1.5", "--dry-plan"]) == 0
    planned = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": python -m " in line)
    assert "--pipeline-stage-layers 2.5,2,2,1.5" in planned["a-dpp"]
    assert "--pipeline-stage-layers" not in planned["a-dpp-v2"] and "--decoder-first" not in planned["a-dpp"]
    assert pipeline_main([*tiny, "--pipeline-stage-layers", "2.5,2,2,1.5", "--split", "3,1", "--dry-plan"]) == 2
    assert pipeline_main([*tiny, "--pipeline-stage-layers", "2.5,2,2", "--dry-plan"]) == 2
    err = capsys.readouterr().err
    assert "--pipeline-stage-layers and --split: give one" in err
    assert "--pipeline-stage-layers 2.5/2/2 gives 3 stages, --pipeline-model-parallel-size is 4" in err
    # the v=2 lines' own: one count per virtual stage
    assert pipeline_main([*tiny, "--pipeline-stage-layers-vp", "1.5,1,1,0.5,1,1,1,1", "--dry-plan"]) == 0
    planned = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": python -m " in line)
    assert "--pipeline-stage-layers 1.5,1,1,0.5,1,1,1,1" in planned["a-dpp-v2"]
    assert "--pipeline-stage-layers" not in planned["a-dpp"]
    assert pipeline_main([*tiny, "--pipeline-stage-layers-vp", "2.5,2,2,1.5", "--split-vp", "2,2", "--dry-plan"]) == 2
    err = capsys.readouterr().err
    assert "--pipeline-stage-layers-vp and --split-vp: give one" in err
    assert "gives 4 stages, 8 are needed: --pipeline-model-parallel-size 4 x 2 virtual stages per rank" in err


def test_the_attention_share_is_measured_once_per_model_and_falls_back_to_flops(monkeypatch) -> None:
    """On CUDA the share comes from trainer.measure.layer_halves, one child process per model however
    often the re-split and the report ask; a failed measurement falls back to FLOPs and says why."""
    import json
    import subprocess

    from trainer.bench import lines

    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        ok = "--hidden-size" in command and command[command.index("--hidden-size") + 1] == "64"
        out = json.dumps({"attention_share": 0.684, "ms": {"attention": [0.6, 1.0], "mlp": [0.2, 0.5]}})
        return subprocess.CompletedProcess(command, 0 if ok else 1, stdout=out if ok else "", stderr="no GPU here")

    monkeypatch.setattr(subprocess, "run", fake_run)
    lines._measured_share.cache_clear()
    cfg = BenchConfig(device="cuda", hidden_size=64, num_attention_heads=4)
    for _ in range(3):
        share, how = lines.layer_attention_share(cfg)
        assert share == 0.684 and how.startswith("measured on this GPU: attention half 1.600 ms"), how
    assert len(calls) == 1 and calls[0][1:3] == ["-m", "trainer.measure.layer_halves"]
    other = dataclasses.replace(cfg, hidden_size=32)
    share, how = lines.layer_attention_share(other)
    assert len(calls) == 2 and "by the model's FLOPs (its measurement failed (exit 1: no GPU here))" in how
    assert 0 < share < 1
    lines._measured_share.cache_clear()
