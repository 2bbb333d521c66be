"""Every recipe's command lines are accepted by the programs they run (the jobs' contract).

tests/unit/test_render_sbatch.py proves the sbatch files run exactly ``jobs.knob_arguments``; this
proves those arguments parse, and pass the trainer's layout checks, in the real entry points.
"""

from __future__ import annotations

import pytest

from trainer.config import parse_config
from trainer.data.preprocess import build_arg_parser as preprocess_parser
from trainer.profiling.aggregate import build_parser as aggregate_parser
from workflows import jobs, recipes

ENV = {"REPO_DIR": "/repo", "OUTPUT_DIR": "/out", "DATA_PATH": "/data"}
TWO_NODES = ["--node-ips", "10.0.0.1,10.0.0.2", "--multi-node"]  # what the sbatch file appends


def arguments(job: jobs.Job, recipe: recipes.Recipe) -> list[str]:
    return jobs.knob_arguments(job, jobs.resolve(job, recipe, ENV))


@pytest.mark.parametrize("recipe", recipes.all_recipes(), ids=lambda r: r.key)
def test_training_arguments_pass_the_trainer_configuration_checks(recipe):
    world = 2 * recipe.gpus_per_node if recipe.gpus_per_node else recipe.parallel.pipeline * recipe.parallel.tensor
    cfg = parse_config(arguments(jobs.TRAIN, recipe) + TWO_NODES, world_size=world)
    assert (cfg.model.num_layers, cfg.optim.train_iters) == (recipe.shape.num_layers, recipe.training.train_iters)
    assert cfg.parallel.use_dpp and cfg.run.device == recipe.device
    assert cfg.checkpoint.save == cfg.checkpoint.load == "/out/checkpoints"


@pytest.mark.parametrize("recipe", recipes.all_recipes(), ids=lambda r: r.key)
def test_preprocessing_and_aggregation_arguments_parse(recipe):
    parsed = preprocess_parser().parse_args(arguments(jobs.PREPROCESS, recipe))
    assert parsed.output_prefix == f"/data/{recipe.tokenization.dataset_dir}/sample"
    assert parsed.split_sentences == recipe.tokenization.split_sentences
    assert str(aggregate_parser().parse_args(arguments(jobs.AGGREGATE, recipe)).benchmark_dir) == "/out/traces"
