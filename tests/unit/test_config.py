"""trainer.config: Megatron flag names, defaults, and one error naming every bad value."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, layout_problems, parse_config

BASE = ["--mock-data", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4"]


def test_megatron_flags_parse_into_typed_sections() -> None:
    cfg = parse_config(BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                               "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "2",
                               "--global-batch-size", "16", "--bf16", "--use-dpp", "--dpp-max-inflight", "3",
                               "--transport", "shm", "--lr", "3e-4", "--node-ips", "10.0.0.1,10.0.0.2",
                               "--device", "cpu", "--save", "/tmp/x", "--save-interval", "5"], world_size=8)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.use_dpp
    assert cfg.parallel.dpp_max_inflight == 3 and cfg.parallel.transport == "shm"
    assert cfg.optim.bf16 and cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.run.node_ips == ("10.0.0.1", "10.0.0.2")
    assert cfg.virtual_pipeline == 2  # 8 layers / PP 2 = 4 per stage, 2 per chunk
    assert cfg.data_parallel(8) == 2 and cfg.num_microbatches(8) == 4
    assert cfg.checkpoint.save_interval == 5


def test_field_errors_are_all_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--micro-batch-size", "0", "--lr", "-1", "--bf16", "--fp16",
                             "--transport", "carrier-pigeon", "--hidden-dropout", "1.5"], world_size=1)
    text = str(err.value)
    for needle in ("--micro-batch-size=0", "--lr=-1.0", "--bf16 and --fp16", "carrier-pigeon", "--hidden-dropout=1.5"):
        assert needle in text
    assert len(err.value.problems) == 5


@pytest.mark.parametrize(("world", "flags", "needles"), [
    (8, ["--num-layers", "6", "--pipeline-model-parallel-size", "4", "--global-batch-size", "4"],
     ["--num-layers=6 is not divisible by --pipeline-model-parallel-size=4"]),
    (6, ["--tensor-model-parallel-size", "4", "--num-attention-heads", "6", "--hidden-size", "48"],
     ["world size 6 is not divisible by --tensor-model-parallel-size=4",
      "--num-attention-heads=6 is not divisible by --tensor-model-parallel-size=4"]),
    (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3",
         "--global-batch-size", "6", "--micro-batch-size", "4"],
     ["4 layers per stage is not divisible by --num-layers-per-virtual-pipeline-stage=3",
      "--global-batch-size=6 is not divisible by --micro-batch-size=4 x data-parallel size 2"]),
    (4, ["--num-gpus", "8"], ["--num-gpus=8 (GPUs per node) does not divide the world size 4"]),
])
def test_impossible_layouts_name_every_offending_value(world, flags, needles) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + flags, world_size=world)
    for needle in needles:
        assert needle in str(err.value)
    assert len(err.value.problems) == len(needles)


def test_data_source_is_required_and_exclusive() -> None:
    with pytest.raises(ConfigError, match="one of --data-path or --mock-data"):
        parse_config(["--num-layers", "2"], world_size=1)
    with pytest.raises(ConfigError, match="--merge-file is required"):
        parse_config(["--data-path", "x", "--vocab-file", "v.json"], world_size=1)


def test_megatron_interleaved_needs_divisible_microbatches_but_dpp_does_not() -> None:
    flags = BASE + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                    "--global-batch-size", "3"]
    with pytest.raises(ConfigError, match="interleaved 1F1B needs microbatches"):
        parse_config(flags, world_size=2)
    cfg = parse_config(flags + ["--use-dpp"], world_size=2)
    assert layout_problems(cfg, 2) == []


# Megatron-LM flags this trainer does not implement (the AWS line's --split/--eval-*, once here, now are).
UNIMPLEMENTED_MEGATRON = ["--num-experts", "4", "--squared-relu", "--wandb-project", "p", "--qk-layernorm"]


def test_unimplemented_megatron_flags_are_refused_in_one_message_with_every_other_problem() -> None:
    """Never accepted and ignored: every unimplemented Megatron-LM flag is named in one problem, next
    to unknown flags, stray values and the field errors of the same command line."""
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + UNIMPLEMENTED_MEGATRON + ["--frobnicate=2", "--lr", "-1", "stray"], world_size=1)
    problems = err.value.problems
    assert problems[0] == ("Megatron-LM flags not implemented by this trainer (refused rather than ignored): "
                           "--num-experts --squared-relu --wandb-project --qk-layernorm")
    assert problems[1].startswith("unknown flags") and problems[1].endswith(": --frobnicate")
    assert problems[2] == "unexpected arguments (no flag takes them): stray"
    assert "--lr=-1.0" in problems[3] and len(problems) == 4


def test_flags_are_never_abbreviated() -> None:
    """argparse's prefix matching took --lr-warmup for --lr-warmup-iters; a prefix is now unknown."""
    with pytest.raises(ConfigError, match="unknown flags .*: --lr-warmup$"):
        parse_config(BASE + ["--lr-warmup", "3"], world_size=1)


def test_train_main_exits_2_on_unimplemented_flags_before_any_process_group(capsys) -> None:
    from trainer.train import main

    assert main(BASE + ["--device", "cpu", "--num-experts", "4", "--squared-relu"]) == 2
    err = capsys.readouterr().err
    assert "not implemented by this trainer (refused rather than ignored): --num-experts --squared-relu" in err
    assert "Traceback" not in err and "usage:" not in err


def test_init_method_std_reaches_megatron_and_must_be_positive() -> None:
    from trainer.launch.topology import Topology
    from trainer.model.build import transformer_config

    cfg = parse_config(BASE + ["--init-method-std", "0.006", "--device", "cpu"], world_size=1)
    assert cfg.model.init_method_std == pytest.approx(0.006)
    assert transformer_config(cfg, Topology(world_size=1, rank=0)).init_method_std == pytest.approx(0.006)
    with pytest.raises(ConfigError, match=r"--init-method-std=0.0 must be > 0"):
        parse_config(BASE + ["--init-method-std", "0"], world_size=1)


@pytest.mark.parametrize(("flags", "iters", "schedule"), [
    # Megatron-LM's get_optimizer_param_scheduler: steps are samples; iteration flags x global batch.
    ([], 10, (0, 80, 80)),
    (["--train-iters", "20", "--lr-warmup-iters", "2", "--lr-decay-iters", "15"], 20, (16, 120, 160)),
    (["--train-iters", "20", "--lr-warmup-fraction", "0.1"], 20, (16, 160, 160)),
    # Sample-based: train_iters = train_samples // global batch (partial last batch dropped).
    (["--train-samples", "100"], 12, (0, 100, 100)),
    (["--train-samples", "100", "--lr-warmup-samples", "10", "--lr-decay-samples", "90"], 12, (10, 90, 100)),
    (["--train-samples", "100", "--lr-warmup-fraction", "0.25", "--lr-decay-samples", "80"], 12, (20, 80, 100)),
])
def test_sample_and_iteration_schedules_map_onto_one_scheduler(flags, iters, schedule) -> None:
    o = parse_config(BASE + ["--global-batch-size", "8"] + flags, world_size=1).optim
    assert o.total_iters == iters
    assert o.lr_schedule_samples == pytest.approx(schedule)


def test_sample_based_training_follows_megatron_rules_naming_every_conflict() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--train-samples", "100", "--train-iters", "5", "--lr-decay-iters", "4",
                             "--lr-warmup-iters", "1", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "3"],
                     world_size=1)
    text = str(err.value)
    for needle in ("--train-iters=5 is iteration-based but --train-samples=100",
                   "--lr-decay-iters=4 is iteration-based", "--lr-warmup-iters=1 is iteration-based",
                   "--lr-warmup-fraction=0.1 and --lr-warmup-samples=3: give only one"):
        assert needle in text
    assert len(err.value.problems) == 4
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--lr-decay-samples", "50", "--lr-warmup-samples", "5", "--lr-warmup-iters", "1",
                             "--lr-warmup-fraction", "1.5", "--train-samples", "0"], world_size=1)
    assert {"--train-samples=0 must be >= 1", "--lr-warmup-fraction=1.5 must be in [0, 1)"} <= set(err.value.problems)
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--lr-decay-samples", "50", "--lr-warmup-samples", "5", "--lr-warmup-iters", "1",
                             "--lr-warmup-fraction", "0.5"], world_size=1)
    assert set(err.value.problems) == {"--lr-decay-samples=50 is sample-based: it needs --train-samples",
                                       "--lr-warmup-samples=5 is sample-based: it needs --train-samples",
                                       "--lr-warmup-fraction=0.5 and --lr-warmup-iters=1: give only one"}


def test_schedule_lengths_megatron_would_assert_on_are_refused_up_front() -> None:
    with pytest.raises(ConfigError, match="less than one iteration of --global-batch-size=8"):
        parse_config(BASE + ["--train-samples", "7", "--global-batch-size", "8"], world_size=1)
    with pytest.raises(ConfigError, match="LR warm-up of 80 samples is not shorter than the decay of 80"):
        parse_config(BASE + ["--train-iters", "10", "--lr-warmup-iters", "10", "--global-batch-size", "8"],
                     world_size=1)


def test_recompute_flags_reach_megatron_as_megatron_lm_passes_them() -> None:
    from trainer.launch.topology import Topology
    from trainer.model.build import transformer_config

    topo = Topology(world_size=1, rank=0)
    selective = parse_config(BASE + ["--device", "cpu", "--recompute-activations"], world_size=1)
    assert transformer_config(selective, topo).recompute_granularity == "selective"
    full = parse_config(BASE + ["--device", "cpu", "--recompute-granularity", "full", "--recompute-method", "block",
                                "--recompute-num-layers", "2"], world_size=1)
    config = transformer_config(full, topo)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 2)
    assert transformer_config(parse_config(BASE, world_size=1), topo).recompute_granularity is None


@pytest.mark.parametrize(("flags", "problems"), [
    (["--recompute-granularity", "full"],
     ["--recompute-granularity full needs --recompute-method uniform|block",
      "--recompute-granularity full needs --recompute-num-layers N"]),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     ["--recompute-method=uniform applies to --recompute-granularity full only, not selective",
      "--recompute-num-layers=2 applies to --recompute-granularity full only, not selective"]),
    (["--recompute-method", "block"],  # megatron-core would ignore it: nothing would be recomputed
     ["--recompute-method=block needs --recompute-granularity full (without it nothing is recomputed)"]),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"],
     ["--recompute-activations means --recompute-granularity selective, not full: give one of them",
      "--recompute-method=uniform applies to --recompute-granularity full only, not selective",
      "--recompute-num-layers=1 applies to --recompute-granularity full only, not selective"]),
    (["--recompute-granularity", "some", "--recompute-method", "all", "--recompute-num-layers", "0"],
     ["--recompute-granularity='some' must be full or selective", "--recompute-method='all' must be uniform or block",
      "--recompute-num-layers=0 must be >= 1",
      "--recompute-method=all needs --recompute-granularity full (without it nothing is recomputed)",
      "--recompute-num-layers=0 needs --recompute-granularity full (without it nothing is recomputed)"]),
])
def test_recompute_rules_name_every_problem(flags, problems) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + flags, world_size=1)
    assert err.value.problems == problems


def test_log_throughput_counts_flops_as_megatron_lm() -> None:
    """GPT 16L h2048 (the docs' 4-GPU model): Megatron-LM's dense formula, term by term."""
    from trainer.measure.flops import flops_per_iteration, tflops_per_gpu

    cfg = parse_config(["--mock-data", "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
                        "--seq-length", "1024", "--max-position-embeddings", "1024", "--global-batch-size", "64",
                        "--micro-batch-size", "2", "--log-throughput"], world_size=4)
    assert cfg.run.log_throughput
    b, s, L, h, f, V = 64, 1024, 16, 2048, 4 * 2048, 50304
    expansion = 3 * 2 * 2  # fwd + 2 x bwd, 2 FLOPs per multiply-add, 2 GEMMs per MLP
    attention = expansion * L * h * h * (1 + 1 + s / h / 2)
    expected = b * s * (expansion * L * h * f + attention + 3 * 2 * h * V)
    assert flops_per_iteration(cfg, V) == pytest.approx(expected, rel=1e-12)
    # Roughly 6 x parameters x tokens (+ attention's s^2 part), as it should be.
    params = L * (4 * h * h + 2 * h * f) + V * h
    assert 1.0 < flops_per_iteration(cfg, V) / (6 * params * b * s) < 1.2
    assert tflops_per_gpu(cfg, V, seconds=0.7, world_size=4) == pytest.approx(expected / (0.7e12 * 4))
