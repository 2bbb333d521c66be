"""Megatron-LM's flags --manual-gc*, --overlap-grad-reduce, --attention-backend / --use-flash-attn:
parsed with Megatron-LM's names and defaults, refused where they would be ignored or cannot run, and
handed to megatron-core (CPU, no process group)."""

from __future__ import annotations

import dataclasses
import types

import pytest

import trainer.config as config_module
from trainer.config import (
    ConfigError,
    attention_backend_problems,
    parse_config,
    resolve_plan,
    uses_transformer_engine_spec,
)
from trainer.config.plan import resolve_cuda_graphs
from trainer.profiling.manual_gc import ManualGC

BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--device", "cpu"]


def _problems(flags: list[str], world_size: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + flags, world_size=world_size)
    return err.value.problems


def test_megatron_defaults_and_names() -> None:
    cfg = parse_config(BASE, world_size=1)
    assert (cfg.run.manual_gc, cfg.run.manual_gc_interval, cfg.run.manual_gc_eval) == (False, 0, True)
    assert cfg.parallel.overlap_grad_reduce is False
    assert (cfg.model.attention_backend, cfg.model.use_flash_attn, cfg.model.attention) == ("auto", False, "auto")
    cfg = parse_config(BASE + ["--manual-gc", "--manual-gc-interval", "5", "--no-manual-gc-eval",
                               "--overlap-grad-reduce", "--attention-backend", "local"], world_size=1)
    assert (cfg.run.manual_gc, cfg.run.manual_gc_interval, cfg.run.manual_gc_eval) == (True, 5, False)
    assert cfg.parallel.overlap_grad_reduce and cfg.model.attention == "local"


def test_these_flags_are_no_longer_refused() -> None:
    cfg = parse_config(BASE + ["--manual-gc", "--manual-gc-interval", "1", "--no-manual-gc-eval",
                               "--overlap-grad-reduce", "--attention-backend", "auto", "--sequence-parallel",
                               "--tensor-model-parallel-size", "2"], world_size=2)
    assert cfg.parallel.sequence_parallel


# ---- --sequence-parallel -----------------------------------------------------------------------
def test_sequence_parallel_reaches_megatron_and_sizes_the_links() -> None:
    from trainer.launch.topology import Topology
    from trainer.model.build import transformer_config
    from trainer.schedule.core import PipelineShape
    from trainer.train import link_options

    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--seq-length", "64"]
    cfg = parse_config(BASE + flags + ["--sequence-parallel"], world_size=4)
    assert transformer_config(cfg, Topology(world_size=4, rank=0, tensor_parallel=2, pipeline_parallel=2)) \
        .sequence_parallel
    shape = PipelineShape(2, cfg.num_microbatches(4), 1)
    # One slot = one activation: [64 / TP, mbs 1, 64] fp32 = 8 KiB with SP, 16 KiB without.
    assert link_options(cfg, shape).shm_slot_bytes == 8192
    assert link_options(parse_config(BASE + flags, world_size=4), shape).shm_slot_bytes == 16384


def test_sequence_parallel_refusals() -> None:
    # Megatron-LM would quietly switch it off at TP 1: refused here.
    assert _problems(["--sequence-parallel"]) == [
        "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence over the tensor-parallel "
        "ranks)"]
    tp2 = ["--sequence-parallel", "--tensor-model-parallel-size", "2"]
    assert _problems(tp2 + ["--seq-length", "15", "--max-position-embeddings", "16"], world_size=2) == [
        "--sequence-parallel needs --seq-length=15 divisible by --tensor-model-parallel-size=2"]
    assert _problems(tp2 + ["--model", "bert"], world_size=2) == [
        "--sequence-parallel is implemented for --model gpt only (BERT's heads and pooler under sequence parallelism "
        "are not wired or tested here)"]
    assert _problems(tp2 + ["--variable-seq-lengths", "--mock-seq-len-dist", "lognormal:0.5",
                            "--seq-length-divisible-by", "3"], world_size=2) == [
        "--sequence-parallel with --variable-seq-lengths needs --seq-length-divisible-by=3 divisible by "
        "--tensor-model-parallel-size=2 (every microbatch length must split evenly)"]
    zb = tp2 + ["--pipeline-model-parallel-size", "2", "--use-dpp", "--dpp-policy", "dpp-zb"]
    assert parse_config(BASE + zb, world_size=4).parallel.dpp_sp_wgrad_input == "keep"
    assert parse_config(BASE + zb + ["--dpp-sp-wgrad-input", "regather"], world_size=4).parallel.dpp_sp_wgrad_input \
        == "regather"
    # The choice applies to a split backward under sequence parallelism only: refused elsewhere.
    assert _problems(tp2 + ["--pipeline-model-parallel-size", "2", "--use-dpp", "--dpp-sp-wgrad-input",
                            "regather"], world_size=4) == [
        "--dpp-sp-wgrad-input=regather applies to --sequence-parallel with a split backward (--dpp-policy dpp-zb or "
        "zb-h1); this run uses --dpp-policy auto: without CUDA graphs dpp-zb was not measured faster"]
    assert _problems(["--dpp-sp-wgrad-input", "gather"]) == [
        "--dpp-sp-wgrad-input='gather' must be one of keep, regather"]


def test_sequence_parallel_norm_marks_its_parameters_for_the_tp_all_reduce() -> None:
    from trainer.launch.topology import Topology
    from trainer.model.build import SequenceParallelLayerNorm, transformer_config

    cfg = parse_config(BASE + ["--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2)
    norm = SequenceParallelLayerNorm(transformer_config(cfg, Topology(world_size=2, rank=0, tensor_parallel=2)), 64)
    assert [getattr(p, "sequence_parallel", False) for p in norm.parameters()] == [True, True]


def test_manual_gc_settings_without_manual_gc_are_refused_not_ignored() -> None:
    problems = _problems(["--manual-gc-interval", "10", "--no-manual-gc-eval"])
    assert problems == ["--manual-gc-interval=10 needs --manual-gc (without it the automatic collector runs and it "
                        "means nothing)",
                        "--no-manual-gc-eval needs --manual-gc (without it the automatic collector runs and it "
                        "means nothing)"]
    assert _problems(["--manual-gc", "--manual-gc-interval", "-1"]) == ["--manual-gc-interval=-1 must be >= 0"]


class _Recorder:
    """Stands in for the gc module."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.on = True

    def isenabled(self) -> bool:
        return self.on

    def disable(self) -> None:
        self.on = False
        self.calls.append(("disable",))

    def enable(self) -> None:
        self.on = True
        self.calls.append(("enable",))

    def collect(self, generation: int = 2) -> None:
        self.calls.append(("collect", generation))


def _loop(run_flags: list[str], iterations: int, eval_interval: int | None) -> list[tuple]:
    """The calls trainer.train's loop makes (start; per iteration eval then interval; stop)."""
    recorder = _Recorder()
    schedule = ManualGC.from_config(parse_config(BASE + run_flags, world_size=1).run, collector=recorder)
    schedule.start()
    for iteration in range(1, iterations + 1):
        recorder.calls.append(("iteration", iteration))
        if eval_interval and iteration % eval_interval == 0:
            schedule.before_eval()
            recorder.calls.append(("eval",))
            schedule.after_eval()
        schedule.after_iteration(iteration)
    schedule.stop()
    return recorder.calls


def test_manual_gc_schedule_is_megatron_lms() -> None:
    calls = _loop(["--manual-gc", "--manual-gc-interval", "3"], 6, eval_interval=2)
    assert calls == [("disable",), ("collect", 2),
                     ("iteration", 1),
                     ("iteration", 2), ("collect", 2), ("eval",), ("collect", 0),
                     ("iteration", 3), ("collect", 2),
                     ("iteration", 4), ("collect", 2), ("eval",), ("collect", 0),
                     ("iteration", 5),
                     ("iteration", 6), ("collect", 2), ("eval",), ("collect", 0), ("collect", 2),
                     ("enable",)]
    # Interval 0 (Megatron-LM's default) never collects between steps; --no-manual-gc-eval not around eval.
    assert _loop(["--manual-gc", "--no-manual-gc-eval"], 4, eval_interval=2) == [
        ("disable",), ("collect", 2), ("iteration", 1), ("iteration", 2), ("eval",), ("iteration", 3),
        ("iteration", 4), ("eval",), ("enable",)]
    # Without --manual-gc nothing is touched.
    assert _loop([], 4, eval_interval=2) == [("iteration", 1), ("iteration", 2), ("eval",), ("iteration", 3),
                                             ("iteration", 4), ("eval",)]


def test_stop_leaves_a_collector_that_was_already_off_off() -> None:
    recorder = _Recorder()
    recorder.on = False
    schedule = ManualGC(enabled=True, collector=recorder)
    schedule.start()
    schedule.stop()
    assert recorder.calls == [("disable",), ("collect", 2)] and not recorder.on


# ---- --overlap-grad-reduce ----------------------------------------------------------------------
def test_overlap_grad_reduce_reaches_megatron_ddp(monkeypatch) -> None:
    import megatron.core.distributed as mcore_distributed

    from trainer.model.build import wrap_ddp

    seen = []

    class FakeDDP:
        def __init__(self, *, config, ddp_config, module, disable_bucketing):
            seen.append((ddp_config.overlap_grad_reduce, disable_bucketing))

    monkeypatch.setattr(mcore_distributed, "DistributedDataParallel", FakeDDP)
    chunks = [types.SimpleNamespace(config=None) for _ in range(2)]
    wrap_ddp(parse_config(BASE + ["--overlap-grad-reduce"], world_size=1), chunks)
    wrap_ddp(parse_config(BASE, world_size=1), chunks[:1])
    assert seen == [(True, False), (True, True), (False, False)]


@pytest.mark.parametrize(("overlap", "schedule", "expect_grad_sync"), [
    (True, "megatron", True),   # Megatron-LM's --align-grad-reduce default: the schedule launches it
    (True, "runtime", False),   # our runtime starts it after the chunk's last backward (grad_sync.py)
    (False, "megatron", False),
])
def test_grad_sync_func_is_set_as_megatron_lm_sets_it(overlap, schedule, expect_grad_sync) -> None:
    from trainer.session.build import wire_grad_sync

    flags = (["--overlap-grad-reduce"] if overlap else []) + (["--use-dpp"] if schedule == "runtime" else [])
    cfg = parse_config(["--mock-data", "--num-layers", "4", "--device", "cuda", "--transformer-impl", "local",
                        *flags], world_size=1)
    config = types.SimpleNamespace(no_sync_func=None, grad_sync_func=None)
    chunk = types.SimpleNamespace(config=config, no_sync=object(), start_grad_sync=object())
    wire_grad_sync([chunk], types.SimpleNamespace(scale_loss=object()), resolve_plan(cfg, 1).schedule)
    assert config.no_sync_func is chunk.no_sync
    assert config.grad_sync_func is (chunk.start_grad_sync if expect_grad_sync else None)


def test_overlap_grad_reduce_is_accepted_with_split_backward_and_graphs() -> None:
    """The runtime starts the reduction after each chunk's last B or W (trainer/pipeline/grad_sync.py),
    so neither I before W nor a replayed backward without hooks rules it out any more."""
    zb = parse_config(BASE + ["--overlap-grad-reduce", "--pipeline-model-parallel-size", "2", "--use-dpp",
                              "--dpp-policy", "dpp-zb", "--use-distributed-optimizer"], world_size=4)
    assert zb.parallel.overlap_grad_reduce and resolve_plan(zb, 4).schedule.policy == "dpp-zb"
    graphs = _problems(["--overlap-grad-reduce", "--pipeline-model-parallel-size", "2", "--use-dpp",
                        "--dpp-cuda-graphs", "--hidden-dropout", "0", "--attention-dropout", "0"], world_size=2)
    assert graphs == ["--dpp-cuda-graphs needs --device cuda (got cpu)"]


# ---- --attention-backend / --use-flash-attn -----------------------------------------------------
def test_attention_backend_reaches_transformer_config() -> None:
    from megatron.core.transformer.enums import AttnBackend

    from trainer.launch.topology import Topology
    from trainer.model.build import transformer_config, use_transformer_engine

    for flags, backend in ((["--attention-backend", "local"], AttnBackend.local), ([], AttnBackend.auto)):
        cfg = parse_config(BASE + flags, world_size=1)
        assert transformer_config(cfg, Topology(world_size=1, rank=0)).attention_backend == backend
        assert use_transformer_engine(cfg) is False


@pytest.mark.parametrize(("flags", "te_installed", "te_spec"), [
    ([], True, True), ([], False, False),
    (["--attention-backend", "local"], True, False),          # Megatron-LM's --spec local
    (["--transformer-impl", "local"], True, False),
    (["--attention-backend", "fused"], True, True), (["--use-flash-attn"], True, True),
    (["--transformer-impl", "transformer_engine"], False, True),
])
def test_layer_spec_follows_the_backend(flags, te_installed, te_spec) -> None:
    # TE-needing choices only validate where TE is installed: the config is built without that check.
    assert uses_transformer_engine_spec(_unchecked(flags, device="cuda"), te_installed) is te_spec


def _unchecked(flags: list[str], device: str):
    """A TrainConfig from flags whose field checks pass, skipping the layout/installation checks."""
    known, _ = config_module.build_parser().parse_known_args(["--mock-data", "--device", device, *flags])
    ns = vars(known)
    sections = {}
    for section in (config_module.ModelConfig, config_module.ParallelConfig, config_module.OptimConfig,
                    config_module.DataConfig, config_module.CheckpointConfig, config_module.RunConfig):
        sections[section.__name__] = section(**{f.name: ns[f"{section.__name__}.{f.name}"]
                                                for f in dataclasses.fields(section)})
    return config_module.TrainConfig(model=sections["ModelConfig"], parallel=sections["ParallelConfig"],
                                     optim=sections["OptimConfig"], data=sections["DataConfig"],
                                     checkpoint=sections["CheckpointConfig"], run=sections["RunConfig"])


def test_te_backends_need_cuda_and_transformer_engine(monkeypatch) -> None:
    assert _problems(["--attention-backend", "fused"]) == [
        "--attention-backend fused needs --device cuda (Transformer Engine's attention kernels are CUDA only); on "
        "CPU use --attention-backend auto or local"]
    installed = set()
    monkeypatch.setattr(config_module.transformer_engine, "installed", lambda module: module in installed)
    cuda = ["--mock-data", "--num-layers", "2", "--device", "cuda"]
    with pytest.raises(ConfigError) as err:
        parse_config(cuda + ["--use-flash-attn"], world_size=1)
    assert err.value.problems == [
        "--use-flash-attn needs Transformer Engine, which is not installed (transformer_engine does not import "
        "here); install it, or use --attention-backend auto or local",
        "--use-flash-attn needs the flash-attn package (Transformer Engine's flash backend calls it), which is not "
        "installed; install flash-attn, or use --attention-backend fused/unfused/auto"]
    installed.add("transformer_engine")
    for backend in ("fused", "unfused", "auto", "local"):
        assert parse_config(cuda + ["--attention-backend", backend], world_size=1).model.attention == backend
    with pytest.raises(ConfigError, match="needs the flash-attn package"):
        parse_config(cuda + ["--attention-backend", "flash"], world_size=1)
    installed.add("flash_attn")
    assert parse_config(cuda + ["--attention-backend", "flash"], world_size=1).model.attention == "flash"
    assert parse_config(cuda + ["--use-flash-attn", "--attention-backend", "flash"], world_size=1).model.attention \
        == "flash"


def test_contradictions_are_refused() -> None:
    assert _problems(["--use-flash-attn", "--attention-backend", "unfused"]) == [
        "--use-flash-attn asks for the flash backend but --attention-backend=unfused: give one of them"]
    assert _problems(["--attention-backend", "sdpa"]) == [
        "--attention-backend='sdpa' must be one of auto, flash, fused, unfused, local"]
    assert _problems(["--attention-backend", "local", "--transformer-impl", "transformer_engine"]) == [
        "--attention-backend local is megatron-core's own attention (the local layer spec) but --transformer-impl "
        "transformer_engine asks for Transformer Engine's: give one of them"]
    local_te = _unchecked(["--attention-backend", "unfused", "--transformer-impl", "local"], device="cuda")
    assert any("--transformer-impl local builds megatron-core's own" in p for p in attention_backend_problems(local_te))


def test_nvte_variables_against_the_backend_are_named() -> None:
    cfg = parse_config(BASE + ["--attention-backend", "local"], world_size=1)
    assert attention_backend_problems(cfg, environ={"NVTE_FLASH_ATTN": "0"}) == []
    assert attention_backend_problems(cfg, environ={"NVTE_FUSED_ATTN": "1"}) == [
        "--attention-backend local sets NVTE_FUSED_ATTN=0 but the environment has NVTE_FUSED_ATTN=1 "
        "(megatron-core refuses the mismatch): unset it"]
    default = parse_config(BASE, world_size=1)
    assert attention_backend_problems(default, environ={"NVTE_FLASH_ATTN": "0"}) == [
        "--attention-backend auto (the default) sets NVTE_FLASH_ATTN=1 but the environment has NVTE_FLASH_ATTN=0 "
        "(megatron-core refuses the mismatch): unset it"]


def test_te_split_backward_runs_graphed_and_auto_picks_it() -> None:
    """A split backward with Transformer Engine's layers replays from the slot graphs like the local
    layers' (each slot copies what its W reads out of the backward pool, trainer/pipeline/graph_operands.py):
    an explicit dpp-zb keeps --use-dpp's default graphs and auto picks dpp-zb with them."""
    flags = ["--attention-backend", "fused", "--pipeline-model-parallel-size", "2", "--use-dpp", "--num-layers", "2"]
    cfg = _unchecked([*flags, "--dpp-policy", "dpp-zb"], device="cuda")
    assert config_module.split_backward_refusals(cfg) == []
    assert resolve_cuda_graphs(cfg)[0]
    auto = _unchecked(flags, device="cuda")
    assert config_module.split_backward_refusals(auto, "dpp-zb") == []
    assert config_module.resolve_dpp_policy(auto)[0] == "dpp-zb"
    regather = _unchecked([*flags, "--dpp-policy", "dpp-zb", "--dpp-eager", "--sequence-parallel",
                           "--tensor-model-parallel-size", "2", "--dpp-sp-wgrad-input", "regather"], device="cuda")
    assert [p for p in config_module.split_backward_refusals(regather) if "regather" in p] == [
        "--dpp-sp-wgrad-input=regather re-gathers the inputs of megatron-core's local linears in W; Transformer "
        "Engine's linears (--attention-backend=fused) keep the operands their backward gathered for their deferred "
        "weight GEMM: drop it (keep)"]
