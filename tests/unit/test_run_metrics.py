"""--metrics-dir during a --rampup-batch-size ramp: each iteration's record and the benchmark's tokens/s
count that iteration's global batch, not --global-batch-size (trainer/measure/run_metrics.py,
trainer/bench/results.py); the layer split travels unrounded."""

from __future__ import annotations

import json

import pytest

from trainer.bench.results import line_result
from trainer.config import parse_config
from trainer.launch.topology import Topology
from trainer.measure.run_metrics import RunMeasurement

FLAGS = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--device", "cpu",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--rampup-batch-size", "2", "2", "12", "--train-samples", "40", "--pipeline-model-parallel-size", "2"]


def test_records_and_tokens_per_second_follow_each_iterations_batch(tmp_path) -> None:
    cfg = parse_config([*FLAGS, "--metrics-dir", str(tmp_path)], world_size=2)
    measure = RunMeasurement(cfg, Topology(world_size=2, rank=1, pipeline_parallel=2), "runtime 1f1b", 8, (2, 2))
    # Batches 2, 2, 4 (ramp), then 8; every step took 100 ms, so tokens/s grows with the batch.
    for step, batch in enumerate([2, 2, 4, 8, 8]):
        measure.after_step(step, 0.1, {"lm loss": 1.0}, batch)
    document = json.loads(measure.write().read_text())
    records = document["iterations"]
    assert document["tokens_per_iteration"] == 8 * 16 and document["num_microbatches"] == 8
    assert [r["global_batch_size"] for r in records] == [2, 2, 4, 8, 8]
    assert [r["num_microbatches"] for r in records] == [2, 2, 4, 8, 8]
    assert [r["tokens"] for r in records] == [32, 32, 64, 128, 128]
    assert [r["tokens_per_s"] for r in records] == pytest.approx([320, 320, 640, 1280, 1280])

    # The benchmark's figure: per iteration its own tokens over its own time (median over 2..5:
    # 320, 640, 1280, 1280 -> 960), not 128 tokens over the median 100 ms (1280).
    result = line_result("k", "dpp", "a", "dpp", tmp_path, skip_iters=1)
    assert result.timed_ms == pytest.approx([100.0] * 4)
    assert result.tokens_per_s == pytest.approx(960.0)


def test_without_a_ramp_the_figure_is_tokens_over_the_median_time(tmp_path) -> None:
    flags = FLAGS[:FLAGS.index("--rampup-batch-size")] + FLAGS[FLAGS.index("--train-samples"):]
    cfg = parse_config([*flags, "--metrics-dir", str(tmp_path)], world_size=2)
    measure = RunMeasurement(cfg, Topology(world_size=2, rank=1, pipeline_parallel=2), "runtime 1f1b", 8, (2, 2))
    for step, seconds in enumerate([0.1, 0.2, 0.3, 0.5]):
        measure.after_step(step, seconds, {"lm loss": 1.0})
    measure.write()
    result = line_result("k", "dpp", "a", "dpp", tmp_path, skip_iters=0)
    assert result.tokens_per_s == pytest.approx(128 / 0.25)


@pytest.mark.parametrize(("split", "read"), [((1.5, 2.5), [1.5, 2.5]), ((2.0, 2.0), [2, 2])])
def test_the_layer_split_is_written_and_read_back_as_the_plan_has_it(tmp_path, split, read) -> None:
    """--pipeline-stage-layers 1.5,2.5 stays 1.5/2.5 through the metrics file and the benchmark's
    reading of it; whole counts come back as ints (a report prints 2, not 2.0)."""
    flags = FLAGS[:FLAGS.index("--rampup-batch-size")] + FLAGS[FLAGS.index("--train-samples"):]
    cfg = parse_config([*flags, "--metrics-dir", str(tmp_path)], world_size=2)
    measure = RunMeasurement(cfg, Topology(world_size=2, rank=1, pipeline_parallel=2), "runtime 1f1b", 8, split)
    measure.after_step(0, 0.1, {"lm loss": 1.0})
    assert json.loads(measure.write().read_text())["layers_per_stage"] == list(split)
    result = line_result("k", "dpp", "a", "dpp", tmp_path, skip_iters=0)
    assert result.layers_per_stage == read and [type(n) for n in result.layers_per_stage] == [type(n) for n in read]
