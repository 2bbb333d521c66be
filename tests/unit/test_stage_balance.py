"""A persistent slow stage, read from measured stage times, is reported with the layer re-split that
fixes it (trainer/schedule/stage_balance.py)."""

from __future__ import annotations

import random

import pytest

from trainer.schedule import simulate
from trainer.schedule.layers import LayerCosts, balanced_split
from trainer.schedule.stage_balance import describe, fit_layer_costs, simulate_args, stage_balance


def _times(costs: LayerCosts, layers: list[int]) -> list[float]:
    return costs.stage_costs(layers)


def test_the_fitted_model_reproduces_every_measured_stage_time() -> None:
    rng = random.Random(14)
    for _ in range(500):
        p = rng.randint(2, 8)
        layers = [rng.randint(1, 12) for _ in range(p)]
        stage_ms = [rng.uniform(1.0, 100.0) for _ in range(p)]
        costs, _ = fit_layer_costs(stage_ms, layers)
        assert costs.stage_costs(layers) == pytest.approx(stage_ms, rel=1e-9), (layers, stage_ms)
        assert costs.layer > 0 and costs.embedding >= 0 and costs.head >= 0


def test_a_heavy_head_is_found_and_the_split_of_the_true_costs_recommended() -> None:
    """The benchmark model's shape: 16 layers, head = 2 layers, embedding 0.2, split evenly; the measured
    times are exactly that model's, so the fit finds it and the re-split is the true optimum."""
    true = LayerCosts(16, layer=24.0, embedding=4.8, head=48.0, attention_share=0.5)
    balance = stage_balance([_times(true, [4, 4, 4, 4])], [4, 4, 4, 4])
    assert (balance.costs.layer, balance.costs.embedding, balance.costs.head) == pytest.approx((24.0, 4.8, 48.0))
    assert balance.slowest == 3 and balance.persistent and balance.recommend
    assert balance.best.layers == balanced_split(true, 4).layers == (4, 5, 5, 2)
    assert balance.best.flags() == ["--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers", "2"]
    assert balance.gain == pytest.approx(1 - 120.0 / 144.0)
    text = describe(balance)
    assert "stage 3 is slowest on average" in text and "re-split 4/5/5/2" in text and "(-17%)" in text


def test_a_slower_middle_gpu_is_fitted_as_a_stage_speed() -> None:
    """Stage 1's GPU 25% slower (docs/schedules.md's straggler case): the fit names it and gives it
    fewer layers: 9/7/7/9 under Megatron's flags (even middle stages), which no custom layout beats
    here (with five stages one does: the next test's case in describe)."""
    true = LayerCosts(32, layer=3.0, stage_speed=(1.0, 1.25, 1.0, 1.0))
    rows = [[t * (1 + 0.01 * ((i + s) % 3 - 1)) for s, t in enumerate(_times(true, [8] * 4))] for i in range(6)]
    balance = stage_balance(rows, [8, 8, 8, 8])
    assert balance.slowest == 1 and balance.slowest_share == 1.0 and balance.iterations == 6
    assert balance.costs.stage_speed[1] == pytest.approx(1.25, rel=0.03)
    assert "stage(s) [1] slower per layer" in balance.fit
    assert balance.best.layers == (9, 7, 7, 9) and balance.recommend
    assert balance.free.bottleneck == pytest.approx(balance.best.bottleneck)
    assert "without Megatron's even middle stages" not in describe(balance)
    five = stage_balance([[24.0, 30.0, 24.0, 24.0, 24.0]], [8] * 5)  # Megatron cannot unload a middle stage
    assert not five.recommend and five.free.layers[1] < 8
    # ... which the trainer lays out with every stage's count
    assert f"without Megatron's even middle stages (--pipeline-stage-layers {','.join(map(str, five.free.layers))}) " \
        in describe(five)


def test_noise_is_not_a_slow_stage() -> None:
    rows = [[100.0, 101.5, 100.0, 100.5], [101.0, 100.0, 100.5, 100.0], [100.0, 100.0, 102.0, 100.0]]
    balance = stage_balance(rows, [4, 4, 4, 4])
    assert not balance.persistent and not balance.recommend
    assert "balanced: no stage is persistently slowest by >= 5% in >= 75% of the iterations" in describe(balance)


def test_a_stage_slowest_in_only_some_iterations_is_not_persistent() -> None:
    """Stage 0 is 40% slower in two of four iterations (say, stalls): its mean is the largest and
    the excess over 5%, but it is the slowest in half the iterations only."""
    rows = [[140.0, 100.0, 100.0, 101.0], [140.0, 100.0, 100.0, 101.0],
            [100.0, 100.0, 100.0, 101.0], [100.0, 100.0, 100.0, 101.0]]
    balance = stage_balance(rows, [4, 4, 4, 4])
    assert balance.slowest == 0 and balance.slowest_share == 0.5 and balance.excess > 0.05
    assert not balance.persistent and not balance.recommend


def test_a_split_already_balanced_for_its_head_is_left_alone() -> None:
    true = LayerCosts(16, layer=1.0, head=2.0)
    balance = stage_balance([_times(true, [5, 4, 4, 3])], [5, 4, 4, 3])
    assert not balance.recommend
    assert "no Megatron split makes the slowest stage faster by >= 2%" in describe(balance)


def test_two_stages_take_the_embedding_as_free() -> None:
    balance = stage_balance([[3.0, 5.0]], [4, 2])
    assert (balance.costs.layer, balance.costs.embedding, balance.costs.head) == pytest.approx((0.75, 0.0, 3.5))
    assert "embedding is taken as free" in balance.fit
    assert balance.best.layers == (5, 1) and balance.recommend


def test_interleaved_splits_move_whole_chunks() -> None:
    true = LayerCosts(32, layer=1.0, embedding=2.0, head=4.0)
    balance = stage_balance([_times(true, [8, 8, 8, 8])], [8, 8, 8, 8], num_chunks=2)
    assert all(n % 2 == 0 for n in balance.best.layers) and balance.best.layers == (6, 10, 10, 6)


def test_the_simulator_replays_the_fit_and_simulates_the_re_split(capsys) -> None:
    """The printed simulator command reproduces the measured stage times (in layer units) and
    simulates the same re-split the balance recommends, for a heavy head and for a slow GPU."""
    head = stage_balance([_times(LayerCosts(16, layer=24.0, embedding=4.8, head=48.0), [4] * 4)], [4] * 4)
    slow = stage_balance([_times(LayerCosts(32, layer=3.0, stage_speed=(1.0, 1.25, 1.0, 1.0)), [8] * 4)], [8] * 4)
    for balance, extra in ((head, []), (slow, ["--straggler", "1:1.25"])):
        args = simulate_args(balance, 32)
        assert args is not None and all(a in args for a in extra), args
        assert simulate.main([*args, "--seeds", "1"]) == 0
        out = capsys.readouterr().out
        assert f"layer split: {'/'.join(map(str, balance.layers))} layers" in out
        assert f"re-split: {'/'.join(map(str, balance.best.layers))} layers" in out, out
    # Two slower stages: more than the simulator's one --straggler can say.
    assert simulate_args(stage_balance([[24.0, 30.0, 24.0, 30.0, 24.0]], [8] * 5), 32) is None


def test_a_half_layer_split_is_fitted_with_its_halves() -> None:
    """--pipeline-stage-layers 4.5/4/4/3.5: a half counts as half a layer's time (an approximation:
    attention and MLP halves cost differently); the fit reproduces the measured times, names the split
    as the run gave it and recommends whole-layer splits only."""
    rng = random.Random(15)
    for _ in range(200):
        p = rng.randint(2, 6)
        layers = [rng.randint(1, 16) / 2 for _ in range(p - 1)]
        layers.append(1.0 if sum(layers) % 1 == 0 else 0.5)  # a whole number of layers in all
        stage_ms = [rng.uniform(1.0, 100.0) for _ in range(p)]
        costs, _ = fit_layer_costs(stage_ms, layers)
        assert costs.stage_costs(layers) == pytest.approx(stage_ms, rel=1e-9), (layers, stage_ms)
        assert costs.num_layers == sum(layers) and isinstance(costs.num_layers, int)
    true = LayerCosts(16, layer=24.0, embedding=4.8, head=48.0, attention_share=0.5)
    balance = stage_balance([_times(true, [4.5, 4, 4, 3.5])], [4.5, 4.0, 4.0, 3.5])
    assert balance.layers == (4.5, 4, 4, 3.5) and balance.current.layers == (4.5, 4, 4, 3.5)
    assert (balance.costs.layer, balance.costs.head) == pytest.approx((24.0, 48.0))
    assert not balance.current.megatron and balance.best.layers == (4, 5, 5, 2)
    assert "layers 4.5/4/4/3.5)" in describe(balance) and "4.5/4/4/3.5 layers, stage costs" in balance.current.describe()
    whole = stage_balance([[100.0, 80.0, 80.0, 120.0]], [4.0, 4.0, 4.0, 4.0])
    assert whole.layers == (4, 4, 4, 4) and "layers 4/4/4/4)" in describe(whole)
    assert whole.current.megatron and whole.current.flags() == []


def test_the_simulator_replays_a_half_layer_split(capsys) -> None:
    balance = stage_balance([_times(LayerCosts(16, layer=24.0, embedding=4.8, head=48.0, attention_share=0.5), [4.5, 4, 4, 3.5])],
                            [4.5, 4, 4, 3.5])
    args = simulate_args(balance, 32)
    assert args is not None and args[args.index("--split") + 1] == "4.5,4,4,3.5"
    assert simulate.main([*args, "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "layer split: 4.5/4/4/3.5 layers, stage costs 4.70, 4.00, 4.00, 5.50" in out, out
    assert "re-split: 4/5/5/2 layers" in out


@pytest.mark.parametrize("split", ["4.25,4,4,3.75", "4.5,4,4,4", "0,8,4,4"])
def test_the_simulator_refuses_a_split_that_is_not_whole_or_half_layers(split, capsys) -> None:
    with pytest.raises(SystemExit):
        simulate.main(["--pp", "4", "--layers", "16", "--split", split])
    assert "need --pp=4 counts > 0, in whole or half layers, summing to --layers=16" in capsys.readouterr().err


@pytest.mark.parametrize(("rows", "layers", "message"), [
    ([[1.0]], [4], "two or more stages"),
    ([[1.0, 2.0, 3.0]], [4, 4], "one time per stage"),
    ([[1.0, 0.0, 3.0]], [4, 4, 4], "stages [1] have no layers or no positive time"),
    ([[1.0, 2.0, 3.0]], [4, 0, 4], "stages [1] have no layers or no positive time"),
    ([[1.0, 2.0, 3.0]], [4, 0.5, 4], "add up to 8.5, not a whole number of layers"),
    ([], [4, 4], "no stage times"),
])
def test_what_cannot_be_fitted_is_refused_by_name(rows, layers, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        stage_balance(rows, layers)


def test_the_benchmark_report_gives_each_lines_stage_balance(tmp_path) -> None:
    """The bench's per-line GPU busy per stage and profiled iteration (metrics gpu_busy) feeds the fit."""
    from trainer.bench.lines import BenchConfig
    from trainer.bench.report import write_report
    from trainer.bench.results import LineResult

    heavy_head = [[480.0, 432.0, 432.0, 480.0], [481.0, 430.0, 433.0, 479.0]]  # 5/4/4/3, head ~2 layers
    even = [[100.0, 96.0, 96.0, 144.0], [101.0, 96.0, 97.0, 143.0]]  # 4/4/4/4, the same model
    meg = LineResult("a-megatron-1f1b-best", "megatron-1f1b-best", "a", "m", timed_ms=[500.0],
                     layers_per_stage=[5, 4, 4, 3], busy_rows=heavy_head,
                     busy_ms={s: sum(r[s] for r in heavy_head) / 2 for s in range(4)})
    dpp = LineResult("a-dpp", "dpp", "a", "d", timed_ms=[450.0], layers_per_stage=[4, 4, 4, 4], busy_rows=even,
                     busy_ms={s: sum(r[s] for r in even) / 2 for s in range(4)})
    report = tmp_path / "r.md"
    write_report(report, BenchConfig(device="cpu"), [meg, dpp], [], {}, {}, 1.0)
    text = report.read_text()
    assert "Stage balance (a cost model fitted to each line's busy time per stage" in text
    assert "- **megatron-1f1b-best**: stage 0 is slowest in 2 of 2 iterations" in text
    assert "; no Megatron split makes the slowest stage faster by >= 2%" in text
    assert "- **dpp**: stage 3 is slowest in 2 of 2 iterations" in text
    assert "; re-split 4/5/5/2: --decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 2" in text
    assert "(this benchmark: `--split 4,2`)" in text


def test_the_benchmark_report_shows_a_half_layer_split(tmp_path) -> None:
    from trainer.bench.lines import BenchConfig
    from trainer.bench.report import write_report
    from trainer.bench.results import LineResult

    rows = [[470.0, 400.0, 400.0, 480.0], [471.0, 401.0, 399.0, 479.0]]
    halves = LineResult("a-dpp", "dpp", "a", "d", timed_ms=[450.0], layers_per_stage=[4.5, 4, 4, 3.5], busy_rows=rows,
                        busy_ms={s: sum(r[s] for r in rows) / 2 for s in range(4)})
    report = tmp_path / "r.md"
    write_report(report, BenchConfig(device="cpu"), [halves], [], {}, {}, 1.0)
    text = report.read_text()
    assert "| dpp | 4.5/4/4/3.5 | 450.0 |" in text, text
    assert "- **dpp**: stage 3 is slowest in 2 of 2 iterations" in text and "layers 4.5/4/4/3.5)" in text
