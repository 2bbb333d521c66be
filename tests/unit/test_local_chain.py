"""`workflows.submit --via local/debug` (the chain on this machine, without Slurm): what it refuses
before anything runs, and that each step runs the very command its sbatch file would
(tests/dist/test_local_chain.py runs a whole chain so)."""

from __future__ import annotations

import pytest

from workflows import jobs, local_chain, recipes, submit


def specs(tmp_path, *argv: str):
    return submit.specs_from_args(submit.build_parser().parse_args(["gpt", "--runs-dir", str(tmp_path), *argv]))


@pytest.mark.parametrize("via", local_chain.VIAS)
def test_slurm_options_and_more_than_one_node_are_refused_by_name(tmp_path, via):
    with pytest.raises(ValueError) as info:
        specs(tmp_path, "--via", via, "--nodes", "2", "--partition", "gpu", "--time", "01:00:00",
              "--sbatch-arg", "mail-type=END", "--sweep", "pp=2,4", "--env", "IMAGE=x.sqsh")
    text = str(info.value)
    assert f"--nodes 2: --via {via} runs on this one machine (--nodes 1)" in text
    assert (f"--partition, --time, --sbatch-arg, --env IMAGE: Slurm (or Pyxis) options, which --via {via} "
            "(no Slurm) cannot honour") in text
    assert "--sweep needs --via submitit" in text


def test_one_node_by_default_and_the_sbatch_files_commands(tmp_path):
    spec, _params, _runs = specs(tmp_path, "--via", "local", "--env", "EXTRA_TRAIN_ARGS=--metrics-dir m")
    assert spec.nodes == 1
    values = jobs.resolve(jobs.TRAIN, recipes.get("gpt"), {**spec.environment(), "REPO_DIR": "/r"})
    argv = local_chain.step_command(jobs.TRAIN, values)
    assert argv == ["-m", "trainer.train", *jobs.knob_arguments(jobs.TRAIN, values), "--metrics-dir", "m"]
    assert argv[argv.index("--run-name") + 1] == spec.run_dir.name
    assert local_chain.world_size(values) == 2  # PP=2 x TP=1 CPU ranks
