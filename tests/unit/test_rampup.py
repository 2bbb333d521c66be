"""--rampup-batch-size: Megatron-LM's batch-size ramp (trainer/config/rampup.py) and its checks."""

from __future__ import annotations

import json

import pytest

from trainer.config import ConfigError, parse_config, resolve_plan
from trainer.config.rampup import BatchRampup

BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--device", "cpu"]


def test_batch_size_follows_megatrons_ramp_by_hand() -> None:
    # 2 -> 8 by 2: three increments over 12 samples, one every 12 / 3 = 4 consumed samples.
    ramp = BatchRampup(start=2, increment=2, samples=12, global_batch_size=8)
    assert ramp.samples_per_increment == 4.0
    by_hand = {0: 2, 3: 2, 4: 4, 7: 4, 8: 6, 11: 6, 12: 8, 13: 8, 1000: 8}
    assert {c: ramp.batch_size_at(c) for c in by_hand} == by_hand
    assert ramp.sizes() == (2, 4, 6, 8)
    # Iterations of 40 samples: batches 2, 2, 4, 6 (14 samples, the ramp is over), then 26 // 8 = 3 more.
    assert ramp.train_iters(40) == 7
    # Training that ends inside the ramp: whole batches only (2 + 2 + 4 = 8 <= 9 < 14).
    assert ramp.train_iters(9) == 3


def test_non_integer_samples_per_increment_as_megatron() -> None:
    # 16 -> 64 by 16 over 100 samples: 3 increments, one every 33.33 samples (a float, floored per step).
    ramp = BatchRampup(16, 16, 100, 64)
    assert [ramp.batch_size_at(c) for c in (0, 33, 34, 66, 67, 100, 101)] == [16, 16, 32, 32, 48, 64, 64]


@pytest.mark.parametrize(("values", "gbs", "needle"), [
    ((0, 2, 12), 8, "the start batch size (0) must be >= 1"),
    ((2, 0, 12), 8, "the batch size increment (0) must be >= 1"),
    ((2, 2, -1), 8, "the ramp-up samples (-1) must be >= 0"),
    ((8, 2, 12), 8, "the start batch size must be below --global-batch-size=8"),
    ((2, 4, 12), 8, "minus the start (6) is not a multiple of the increment 4"),
])
def test_bad_ramps_are_named(values, gbs, needle) -> None:
    problems = BatchRampup(*values, gbs).problems()
    assert len(problems) == 1 and needle in problems[0]
    assert problems[0].startswith("--rampup-batch-size " + " ".join(map(str, values)))


def test_flag_parses_and_sets_iterations_and_plan() -> None:
    cfg = parse_config(BASE + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                               "--rampup-batch-size", "4", "2", "8", "--train-samples", "40"], world_size=2)
    assert cfg.optim.rampup_batch_size == (4, 2, 8)
    # 4 -> 8 by 2 over 8 samples (one increment every 4): batches 4, 6 (10 samples, past the ramp),
    # then (40 - 10) // 8 = 3.
    assert cfg.optim.total_iters == 5
    assert [cfg.optim.batch_size_at(c) for c in (0, 3, 4, 8, 14)] == [4, 4, 6, 8, 8]
    plan = resolve_plan(cfg, 2)
    assert plan.num_microbatches == 8 and [plan.microbatches_of(b) for b in cfg.optim.batch_sizes] == [4, 6, 8]


def test_megatron_lms_175b_example_pairs_the_ramp_with_train_iters() -> None:
    # examples/gpt3/train_gpt3_175b_distributed.sh: --rampup-batch-size 16 16 5859375 --train-iters 500000
    # (sizes shrunk: 2 ranks of PP, mbs 1): --train-iters iterations, the ramp by consumed samples.
    cfg = parse_config(BASE + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "64",
                               "--rampup-batch-size", "16", "16", "5859375", "--train-iters", "500000",
                               "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000"], world_size=2)
    assert cfg.optim.total_iters == 500000
    assert [cfg.optim.batch_size_at(c) for c in (0, 1953124, 1953125, 5859376)] == [16, 16, 32, 64]  # one increment every 5859375 / 3


def test_every_size_of_the_ramp_must_cut_into_microbatches() -> None:
    # DP 2 x mbs 2 = 4: 6 is not divisible (4, giving 1 microbatch under PP 2, is fine: see below).
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                             "--global-batch-size", "16", "--rampup-batch-size", "4", "2", "100",
                             "--train-samples", "400"], world_size=4)
    assert err.value.problems == [f"global batch size {size} (of --rampup-batch-size up to --global-batch-size=16) "
                                  "is not divisible by --micro-batch-size=2 x data-parallel size 2"
                                  for size in (6, 10, 14)]


@pytest.mark.parametrize("flags", [
    [],  # the runtime's 1F1B standing in for megatron-core's on CPU
    ["--use-dpp", "--dpp-policy", "dpp"], ["--use-dpp", "--dpp-policy", "dpp-zb"],
    ["--use-dpp", "--dpp-policy", "zb-h1"], ["--use-dpp", "--dpp-policy", "1f1b"],
    ["--use-dpp", "--dpp-policy", "dpp", "--num-layers-per-virtual-pipeline-stage", "1"],
])
def test_a_ramp_may_start_below_the_pipeline_depth(flags) -> None:
    # Megatron-LM's 175b example: PP=16 and a ramp from 16 samples (micro 1): with DP > 1 the first
    # iterations have fewer microbatches than stages, which megatron-core's 1F1B runs. Here PP=4, 2 -> 8.
    cfg = parse_config(BASE + ["--pipeline-model-parallel-size", "4", "--micro-batch-size", "1",
                               "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
                               "--train-samples", "40", *flags], world_size=4)
    plan = resolve_plan(cfg, 4)
    assert [plan.microbatches_of(b) for b in cfg.optim.batch_sizes] == [2, 4, 6, 8]


@pytest.mark.parametrize(("flags", "needle"), [
    (["--use-dpp", "--dpp-policy", "interleaved"], "--dpp-policy=interleaved needs microbatches (2) divisible"),
    ([], "the runtime's interleaved 1F1B (standing in for megatron-core's without --use-dpp here) needs "
         "microbatches (2) divisible"),
])
def test_interleaved_orders_still_need_whole_groups_of_pp(flags, needle) -> None:
    # megatron-core's interleaved schedule refuses M < PP (its microbatch groups are PP long).
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                             "--num-layers", "8", "--micro-batch-size", "1", "--global-batch-size", "8",
                             "--rampup-batch-size", "2", "2", "12", "--train-samples", "40", *flags], world_size=4)
    assert needle in str(err.value) and "at global batch size 2 of --rampup-batch-size" in str(err.value)


def test_interleaved_order_is_checked_at_every_size() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                             "--use-dpp", "--dpp-policy", "interleaved", "--global-batch-size", "8",
                             "--rampup-batch-size", "2", "1", "12", "--train-samples", "80"], world_size=2)
    text = str(err.value)
    assert "microbatches (3) divisible by --pipeline-model-parallel-size=2" in text
    assert "at global batch size 3 of --rampup-batch-size" in text


def test_trace_of_a_ramp_names_each_iterations_microbatches(tmp_path) -> None:
    from trainer.profiling.tracer import make_tracer
    from trainer.profiling.validate import _schedule_problems

    meta = {"stage": 0, "world_size": 1, "pipeline_parallel": 1, "num_chunks": 1, "num_microbatches": 2,
            "schedule": "dpp", "run_id": "1.0-0badcafe"}
    tracer = make_tracer(tmp_path, rank=0, metadata=meta)
    ran = {1: 1, 2: 2}  # iteration 1 of the ramp: one microbatch; iteration 2: the full two
    for iteration, count in ran.items():
        tracer.set_iteration(iteration)
        tracer.set_microbatches(iteration, count)
        for m in range(count):
            for op in "FB":
                with tracer.span(f"{op}{m}.c0", op, microbatch=m, chunk=0):
                    pass
    tracer.close()
    (trace,) = tmp_path.rglob("*.json")
    written = json.loads(trace.read_text())
    metadata = written["metadata"]
    assert metadata["microbatches_by_iteration"] == {"1": 1}  # iteration 2 has the metadata's count
    compute = [e for e in written["traceEvents"] if e.get("cat") in ("F", "B")]
    assert _schedule_problems(compute, metadata) == []
    assert _schedule_problems(compute, {**metadata, "microbatches_by_iteration": {}}) == [
        "pid 0 iteration 1: missing: B1.c0, F1.c0"]


def test_graphs_stay_on_under_a_ramp_and_the_first_line_says_why() -> None:
    cfg = parse_config(["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                        "--pipeline-model-parallel-size", "2", "--use-dpp", "--transformer-impl", "local",
                        "--micro-batch-size", "2", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24",
                        "--train-samples", "96"], world_size=2)
    schedule = resolve_plan(cfg, 2).schedule
    assert schedule.cuda_graphs
    assert "--rampup-batch-size: slots captured for the full batch" in schedule.log_text


@pytest.mark.parametrize(("name", "chunks"), [("1f1b", 1), ("zb-h1", 1), ("dpp", 1), ("dpp-zb", 1),
                                              ("dpp", 2), ("dpp-zb", 2)])
def test_every_policy_finishes_steps_below_the_pipeline_depth_within_the_full_batchs_slots(name, chunks) -> None:
    # The ramp's small steps (M < PP) under the policy the runtime builds for that M: the simulator
    # raises DeadlockError on a stuck stage, and no stage holds more activations than the CUDA graph
    # slots captured for the full batch's policy (pipeline/runtime.py's graph_slots).
    import numpy as np

    from trainer.pipeline.runtime import graph_slots
    from trainer.schedule.core import PipelineShape
    from trainer.schedule.costs import CostModel
    from trainer.schedule.registry import make_policy
    from trainer.schedule.simulator import simulate

    full = PipelineShape(4, 8, chunks)
    slots = [sum(graph_slots(make_policy(name, full, s), full, s)) for s in range(4)]
    for m in (1, 2, 3):
        shape = PipelineShape(4, m, chunks)
        result = simulate(shape, [make_policy(name, shape, s) for s in range(4)],
                          CostModel().draw(shape, np.random.default_rng(m)))
        assert result.step_time > 0
        assert all(peak <= slot for peak, slot in zip(result.peak_inflight, slots, strict=True)), (m, result.peak_inflight)
        assert max(result.peak_inflight) <= m * chunks
