"""Recipes, the knob table and the chain's pure helpers (no Slurm needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from workflows import chain, jobs, recipes, render, slurm
from workflows.shell import Ref

REPO = Path(__file__).resolve().parents[2]


def test_cpu_demo_recipes_match_the_trainer_contract():
    gpt = recipes.get("gpt")
    assert (gpt.parallel.pipeline, gpt.parallel.tensor, gpt.nodes, gpt.device) == (2, 1, 2, "cpu")
    assert dataclasses.astuple(gpt.shape) == (4, 64, 4, 64, 64)
    assert (gpt.training.micro_batch_size, gpt.training.global_batch_size, gpt.training.train_iters) == (2, 16, 20)
    bert = recipes.get("bert")
    assert bert.tokenization.split_sentences and bert.tokenization.merge_file is None
    assert bert.tokenization.dataset_suffix == "_text_sentence"
    assert gpt.tokenization.dataset_suffix == "_text_document"


@pytest.mark.parametrize("recipe", recipes.all_recipes(), ids=lambda r: r.key)
def test_every_recipe_points_at_shipped_files(recipe):
    tok = recipe.tokenization
    for path in (recipe.corpus, tok.vocab_file, tok.merge_file):
        assert path is None or (REPO / path).is_file(), path


def test_gpu_recipes_request_gpus_and_bf16():
    for model in recipes.RECIPES:
        recipe = recipes.get(model, "gpu")
        assert recipe.gpus_per_node > 0 and recipe.bf16 and recipe.device == "cuda"


def test_validation_names_every_bad_value():
    with pytest.raises(ValueError) as err:
        recipes.ModelShape(num_layers=0, hidden_size=64, num_attention_heads=4, seq_length=0,
                           max_position_embeddings=64)
    assert "num_layers=0" in str(err.value) and "seq_length=0" in str(err.value)
    with pytest.raises(ValueError, match="hidden_size=65 is not divisible by num_attention_heads=4"):
        recipes.ModelShape(4, 65, 4, 64, 64)
    with pytest.raises(ValueError, match="global_batch_size=15 is not a multiple of micro_batch_size=2"):
        recipes.TrainingSchedule(2, 15, 10, 1e-3, save_interval=5)
    with pytest.raises(ValueError, match="merge_file=None must be set exactly for GPT2BPETokenizer"):
        recipes.Tokenization("GPT2BPETokenizer", "v.json", None, "gpt2")
    gpt = recipes.get("gpt")
    with pytest.raises(ValueError) as err:
        dataclasses.replace(gpt, model="t5", nodes=0, bf16=True)
    assert all(s in str(err.value) for s in ("model='t5'", "nodes=0", "bf16=True"))


def test_unknown_recipe_or_size_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="unknown recipe 'llama'; choose one of gpt, bert"):
        recipes.get("llama")
    with pytest.raises(ValueError, match="unknown size 'tpu'"):
        recipes.get("gpt", "tpu")


def test_every_knob_has_a_default_in_every_recipe():
    for recipe in recipes.all_recipes():
        assert jobs.KNOB_NAMES <= set(jobs.defaults(recipe)), recipe.key


def test_resolve_applies_overrides_and_references_like_bash():
    values = jobs.resolve(jobs.TRAIN, recipes.get("bert"), {"REPO_DIR": "/r", "DATA_PATH": "/fsx", "PP": "4",
                                                            "SLURM_JOB_ID": "42"})
    assert values["DATASET"] == "/fsx/bert/sample_text_sentence"
    assert values["CHECKPOINT_DIR"] == "/r/runs/bert-42/checkpoints"  # each job its own folder
    assert values["PP"] == "4" and values["MERGE_FILE"] == ""
    args = jobs.knob_arguments(jobs.TRAIN, values)
    assert args[:2] == ["--model", "bert"] and "--merge-file" not in args
    assert args[args.index("--save") + 1] == args[args.index("--load") + 1] == "/r/runs/bert-42/checkpoints"


def test_a_reference_to_a_later_variable_is_refused_at_render_time():
    bad = jobs.Job("bad", "x.sbatch", "m", "00:01:00", (
        jobs.Knob("DATA_PATH", "shared"),
        jobs.Knob("DATASET", "reads DATA_PREFIX before it is set", ("--data-path",)),
        jobs.Knob("DATA_PREFIX", "set too late"),
    ))
    with pytest.raises(ValueError, match=r"DATASET refers to \$DATA_PREFIX before it is set"):
        render.arrange(bad, recipes.all_recipes())


def test_arrange_hoists_shared_defaults_and_keeps_references_after_their_targets():
    settings = render.arrange(jobs.TRAIN, recipes.all_recipes())
    hoisted = [k.env for k, _ in settings.hoisted]
    varying = [k.env for k, _ in settings.branches[0][1]]
    trailing = [k.env for k, _ in settings.trailing]
    assert "TP" in hoisted and "NUM_LAYERS" in varying and trailing == []
    assert [key for key, _ in settings.branches] == [r.key for r in recipes.all_recipes()]
    # OUTPUT_DIR's default (the job's own folder) is the same for every recipe: both are hoisted
    assert hoisted.index("OUTPUT_DIR") < hoisted.index("CHECKPOINT_DIR")
    assert dict((k.env, v) for k, v in settings.hoisted)["CHECKPOINT_DIR"] == Ref("OUTPUT_DIR", "/checkpoints")


def make_spec(tmp_path, **changes):
    fields = {"recipe": recipes.get("gpt"), "nodes": 2, "repo_dir": REPO, "run_dir": tmp_path / "run"}
    return chain.ChainSpec(**{**fields, **changes})


def test_chain_spec_rejects_bad_nodes_and_unknown_settings(tmp_path):
    with pytest.raises(ValueError) as err:
        make_spec(tmp_path, nodes=0, overrides={"NUM_LAYER": "3"})
    assert "--nodes 0: must be >= 1" in str(err.value) and "unknown setting(s) NUM_LAYER" in str(err.value)


def test_chain_spec_environment_and_missing_inputs(tmp_path):
    spec = make_spec(tmp_path, overrides={"TRAIN_ITERS": "7"}, image=None)
    env = spec.environment()
    assert env["MODEL"] == "gpt" and env["TRAIN_ITERS"] == "7" and env["DATA_PATH"] == str(tmp_path / "run/data")
    assert "IMAGE" not in env and spec.missing_inputs() == []
    spec = make_spec(tmp_path, overrides={"INPUT": "datasets/none.jsonl", "VOCAB_FILE": "v.json"})
    assert spec.missing_inputs() == ["INPUT=datasets/none.jsonl", "VOCAB_FILE=v.json"]
    assert make_spec(tmp_path, overrides={"INPUT": "x"}, image="img.sqsh").missing_inputs() == []


def test_chain_names_find_the_siblings_of_any_step():
    run = Path("/runs/gpt-20261126-020000-ab12")
    for step in chain.STEPS:
        assert chain.chain_names(chain.job_name(run, step)) == [chain.job_name(run, s) for s in chain.STEPS]
    assert chain.chain_names("mdpp-train") is None  # the committed files' own name: a lone job
    assert chain.chain_names("wrap") is None


def test_sacct_parsing_keeps_the_state_word_and_skips_noise():
    text = "12|mdpp-x-train|CANCELLED by 0|0:15|00:00:03|node[1-2]|a|b\nwarning: something\n"
    assert slurm.parse_sacct(text) == [slurm.JobRecord("12", "mdpp-x-train", "CANCELLED", "0:15", "00:00:03",
                                                       "node[1-2]")]
    assert slurm.parse_sacct(text)[0].finished
    assert not slurm.JobRecord("1", "n", "REQUEUED", "0:0", "", "").finished


def test_sbatch_options_chain_the_jobs_and_request_gpus_only_for_training(tmp_path):
    spec = make_spec(tmp_path, recipe=recipes.get("bert", "gpu"), gpus_per_node=4, partition="gpu")
    logs = tmp_path / "logs"
    pre = chain.sbatch_options(spec, "preprocess", logs, after=None)
    train = chain.sbatch_options(spec, "train", logs, after="afterok:11")
    agg = chain.sbatch_options(spec, "aggregate", logs, after="afterany:12")
    assert pre == ["--job-name=mdpp-run-preprocess", f"--output={logs}/%x_%j.out", f"--chdir={REPO}",
                   "--partition=gpu", "--cpus-per-task=16"]
    assert train[-8:] == ["--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=1", "--gpus-per-node=4",
                          "--exclusive", "--wait-all-nodes=1", "--dependency=afterok:11", "--kill-on-invalid-dep=yes"]
    assert agg[-2:] == ["--dependency=afterany:12", "--kill-on-invalid-dep=yes"]
    assert not any(o.startswith(("--nodes", "--gpus")) for o in pre + agg)
    assert spec.environment()["SIZE"] == "gpu" and spec.environment()["GPUS_PER_NODE"] == "4"


@pytest.mark.parametrize(("nodes", "overrides", "per_node"), [(1, {}, 2), (2, {}, 1), (1, {"PP": "4"}, 4),
                                                              (2, {"PP": "2", "TP": "2"}, 2)])
def test_training_allocation_asks_for_every_rank_on_its_node(tmp_path, nodes, overrides, per_node):
    """Before: no --ntasks-per-node, so `submit gpt --nodes 1` (2 ranks on one node) was refused by srun."""
    spec = make_spec(tmp_path, nodes=nodes, overrides=overrides)
    train = chain.sbatch_options(spec, "train", tmp_path, after=None)
    assert f"--ntasks-per-node={per_node}" in train and "--cpus-per-task=1" in train


def test_a_layout_that_does_not_split_over_the_nodes_is_refused_before_submitting(tmp_path):
    """Before: --env PP=3 on 2 nodes failed 20 s into the chain."""
    with pytest.raises(ValueError, match=r"3 training ranks \(PP=3 x TP=1\) do not split evenly over --nodes 2"):
        make_spec(tmp_path, nodes=2, overrides={"PP": "3"})
