"""trainer.config.plan: the schedule, its options and why, the layer split and the link options are
decided once (resolve_plan), and no module outside trainer/config/ decides them again from flags."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import pytest

from trainer.bench.lines import balanced_split as bench_balanced_split
from trainer.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RunPlan,
    TrainConfig,
    parse_config,
    resolve_plan,
)
from trainer.config.layout import _stage_split_problems
from trainer.schedule import layers as layer_split

REPO = Path(__file__).resolve().parents[2]

SCHEDULE_FLAGS = frozenset({"use_dpp", "dpp_policy", "dpp_cuda_graphs", "dpp_max_queued_ops", "dpp_max_inflight",
                            "dpp_cap_factor", "dpp_fill_transit", "dpp_land_forwards", "dpp_recompute_slots",
                            "dpp_sp_wgrad_input", "dpp_eager", "dpp_held_cap"})
"""ParallelConfig fields that decide which schedule runs and with which options: the plan's alone."""
DECIDERS = frozenset({"resolve_dpp_policy", "resolve_cuda_graphs", "auto_graph_problems", "uses_megatron_schedule",
                      "schedule_plan", "split_backward_refusals", "te_rng_tracker", "rng_plan"})
"""The plan's deciding functions: called by trainer/config/ alone (everyone else reads the RunPlan)."""


def _readers(path: Path, source: str | None = None) -> list[str]:
    """Places in ``path`` that read a schedule flag off the parallel section or call a decider."""
    out = []
    path = REPO / path
    for node in ast.walk(ast.parse(source if source is not None else path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr in SCHEDULE_FLAGS:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("parallel", "par"):
                out.append(f"{path.relative_to(REPO)}:{node.lineno} reads .{node.attr}")
        elif isinstance(node, ast.Name | ast.Attribute) and (getattr(node, "id", None) or getattr(node, "attr", None)) \
                in DECIDERS:
            out.append(f"{path.relative_to(REPO)}:{node.lineno} uses {getattr(node, 'id', None) or node.attr}")
        elif isinstance(node, ast.ImportFrom) and any(a.name in DECIDERS for a in node.names):
            out.append(f"{path.relative_to(REPO)}:{node.lineno} imports a decider")
    return out


def test_the_schedule_is_decided_in_the_plan_alone() -> None:
    """Every reader holds to the plan: outside trainer/config/ no module reads --use-dpp, --dpp-policy,
    --dpp-cuda-graphs or the policy's options off the configuration, nor calls the plan's deciders."""
    files = [f for f in sorted((REPO / "trainer").rglob("*.py")) if "config" not in f.relative_to(REPO).parts[1:2]]
    assert len(files) > 50
    offenders = [place for f in files for place in _readers(f)]
    assert not offenders, "decide from the RunPlan (trainer/config/plan.py), not from flags: " + "; ".join(offenders)
    # The check itself sees such reads (it could fail).
    probe = "par = cfg.parallel\nx = cfg.parallel.dpp_policy, par.use_dpp\nfrom trainer.config import resolve_dpp_policy\n"
    assert len(_readers(Path("trainer/probe.py"), probe)) == 3


def test_the_config_does_not_reach_back_into_the_checks() -> None:
    assert not hasattr(TrainConfig, "dpp_policy") and not hasattr(ParallelConfig, "max_queued_ops")


CPU_PP2 = ["--mock-data", "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
CUDA_PP2 = [*CPU_PP2, "--device", "cuda", "--transformer-impl", "local"]
GRAPHS = ["--use-dpp", "--dpp-cuda-graphs", "--hidden-dropout", "0", "--attention-dropout", "0"]
CPU_EAGER = "eager: --dpp-cuda-graphs needs --device cuda (got cpu)"
AUTO_GRAPHS = "graphs: --use-dpp's default where they can run (--dpp-eager turns them off)"
AUTO_ZB = ("dpp-zb (--dpp-policy auto: with CUDA graphs dpp-zb is the faster (its later stages may hold up to stage "
           "0's 1F1B bound: --dpp-held-cap))")
FIT = ("held cap fitted to memory: each stage's own 1F1B bound, then slots up to stage 0's while within the "
       "largest rank's memory (--dpp-held-cap auto)")


def _plan(argv: list[str], world_size: int = 2) -> RunPlan:
    return resolve_plan(parse_config(argv, world_size=world_size), world_size)


@pytest.mark.parametrize(("argv", "engine", "policy", "log_text", "split"), [
    (CUDA_PP2, "megatron-core", "1f1b", "megatron-core", False),
    ([*CUDA_PP2, "--num-virtual-stages-per-pipeline-rank", "2"], "megatron-core", "interleaved", "megatron-core",
     False),
    (CPU_PP2 + ["--device", "cpu"], "runtime", "1f1b", "1f1b policy", False),  # CPU: megatron-core's interleaved P2P is not exact over gloo
    (CPU_PP2 + ["--device", "cpu", "--num-virtual-stages-per-pipeline-rank", "2"], "runtime", "interleaved",
     "1f1b policy", False),
    ([*CUDA_PP2, "--distributed-backend", "gloo"], "runtime", "1f1b", "1f1b policy", False),  # ranks share a GPU
    (CPU_PP2 + ["--device", "cpu", "--use-dpp"], "runtime", "dpp", "dpp (--dpp-policy auto: without "
     f"CUDA graphs dpp-zb was not measured faster); {CPU_EAGER}", False),
    (CPU_PP2 + ["--device", "cpu", "--use-dpp", "--dpp-policy", "dpp"], "runtime", "dpp", f"dpp; {CPU_EAGER}", False),
    (CPU_PP2 + ["--device", "cpu", "--use-dpp", "--dpp-policy", "dpp-zb"], "runtime", "dpp-zb",
     f"dpp-zb; {CPU_EAGER}", True),
    (CPU_PP2 + ["--device", "cpu", "--dpp-policy", "zb-h1"], "runtime", "zb-h1", "zb-h1", True),
    (CPU_PP2 + ["--device", "cpu", "--use-dpp", "--dpp-policy", "zb-h1"], "runtime", "zb-h1", f"zb-h1; {CPU_EAGER}",
     True),
    ([*CUDA_PP2, *GRAPHS], "runtime", "dpp-zb", f"{AUTO_ZB}; graphs: --dpp-cuda-graphs; {FIT}", True),
    ([*CUDA_PP2, "--use-dpp"], "runtime", "dpp-zb", f"{AUTO_ZB}; {AUTO_GRAPHS}; {FIT}", True),
    ([*CUDA_PP2, "--use-dpp", "--dpp-eager"], "runtime", "dpp", "dpp (--dpp-policy auto: without CUDA graphs dpp-zb "
     "was not measured faster); eager: --dpp-eager", False),
])
def test_resolve_plan_over_layouts(argv, engine, policy, log_text, split) -> None:
    schedule = _plan(argv).schedule
    assert (schedule.engine, schedule.policy, schedule.log_text, schedule.split_backward) == \
        (engine, policy, log_text, split)
    assert schedule.label == f"{engine} {policy}" and schedule.reason
    assert (schedule.options is not None) == (policy in ("dpp", "dpp-zb"))


def test_the_plan_holds_the_options_the_runtime_uses() -> None:
    graphed = _plan([*CUDA_PP2, *GRAPHS, "--dpp-recompute-slots", "1", "--dpp-cap-factor", "1.5"]).schedule
    assert graphed.cuda_graphs and graphed.max_queued_ops == 1 and graphed.recompute_slots_of(0) == 1
    assert graphed.recompute_slots_of(1) == 0
    assert graphed.policy_kwargs == {"max_inflight": None, "cap_factor": 1.5, "fill_transit": True}
    eager = _plan(CPU_PP2 + ["--device", "cpu", "--use-dpp", "--dpp-max-inflight", "3"]).schedule
    assert eager.max_queued_ops == 0 and eager.policy_kwargs == {"max_inflight": 3, "cap_factor": 1.0}
    assert _plan([*CUDA_PP2, "--overlap-grad-reduce"]).schedule.megatron_grad_sync
    assert not _plan([*CUDA_PP2, "--use-dpp", "--overlap-grad-reduce"]).schedule.megatron_grad_sync
    # --overlap-param-gather: the runtime starts and waits for the all-gathers; megatron-core's hooks otherwise
    gather = ["--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather"]
    assert _plan([*CUDA_PP2, "--use-dpp", *gather]).schedule.runtime_param_gather
    assert _plan([*CPU_PP2, "--device", "cpu", *gather]).schedule.runtime_param_gather  # the runtime's 1f1b
    assert not _plan([*CUDA_PP2, *gather]).schedule.runtime_param_gather
    assert not _plan([*CUDA_PP2, "--use-dpp", "--overlap-grad-reduce"]).schedule.runtime_param_gather
    with pytest.raises(dataclasses.FrozenInstanceError):
        eager.policy = "zb-h1"  # type: ignore[misc]


def test_the_held_cap_basis_reaches_each_stage_s_policy_and_its_graph_slots() -> None:
    """--dpp-held-cap stage: dpp-zb holds each stage's own 1F1B bound (4/3/2/1 graph slots at PP=4) instead of
    stage 0's on every stage (auto); refused beside a fixed cap or without a dynamic policy."""
    from trainer.pipeline.runtime import graph_slots
    from trainer.schedule.registry import make_policy

    pp4 = ["--mock-data", "--num-layers", "8", "--pipeline-model-parallel-size", "4", "--global-batch-size", "16",
           "--device", "cuda", "--transformer-impl", "local", *GRAPHS, "--dpp-policy", "dpp-zb"]

    def slots(argv: list[str]) -> list[int]:
        plan = _plan(argv, world_size=4)
        policies = [make_policy(plan.schedule.policy, plan.shape, s, **plan.schedule.policy_kwargs) for s in range(4)]
        return [graph_slots(p, plan.shape, s)[0] for s, p in enumerate(policies)]

    auto = _plan(pp4, world_size=4).schedule  # graphed dpp-zb: fit, built at the peak bound, the capture decides
    assert auto.held_fit and auto.policy_kwargs["cap_basis"] == "peak" and slots(pp4) == [4, 4, 4, 4]
    assert _plan([*pp4, "--dpp-held-cap", "fit"], world_size=4).schedule.held_fit
    assert not _plan([*pp4, "--dpp-held-cap", "peak"], world_size=4).schedule.held_fit
    assert not _plan([*pp4, "--dpp-cap-factor", "1.5"], world_size=4).schedule.held_fit  # auto keeps peak there
    eager = [*CPU_PP2, "--device", "cpu", "--use-dpp", "--dpp-policy", "dpp-zb"]
    assert not _plan(eager).schedule.held_fit and "cap_basis" not in _plan(eager).schedule.policy_kwargs
    assert _plan([*pp4, "--dpp-held-cap", "stage"], world_size=4).schedule.policy_kwargs["cap_basis"] == "stage"
    assert slots([*pp4, "--dpp-held-cap", "stage"]) == [4, 3, 2, 1]
    assert slots([*pp4[:-1], "dpp", "--dpp-held-cap", "peak"]) == [4, 4, 4, 4]
    for argv, why in (([*pp4, "--dpp-held-cap", "stage", "--dpp-max-inflight", "3"], "give one"),
                      ([*CPU_PP2, "--dpp-held-cap", "stage"], "applies to --use-dpp with --dpp-policy dpp/dpp-zb"),
                      ([*CPU_PP2, "--use-dpp", "--dpp-policy", "zb-h1", "--dpp-held-cap", "peak"], "applies to")):
        with pytest.raises(ConfigError, match=f"--dpp-held-cap=.*{why}"):
            _plan(argv)
    for argv, world, why in (([*eager, "--dpp-held-cap", "fit"], 2, "graphs off, 1 chunk"),
                             ([*pp4, "--dpp-held-cap", "fit", "--dpp-cap-factor", "1.5"], 4, "cap factor 1.5")):
        with pytest.raises(ConfigError, match=f"--dpp-held-cap fit measures the CUDA graph slots' memory.*{why}"):
            _plan(argv, world_size=world)


def test_per_chunk_caps_under_graphs_give_each_chunk_the_interleaved_order_s_slots() -> None:
    """--dpp-chunk-caps auto: at two chunks per stage under CUDA graphs each chunk holds (and captures) what
    megatron-core's interleaved order holds in it (8/4 on stage 0 at PP=4, M=32) instead of the stage's whole
    cap in every chunk (11/11); eager, at one chunk, or with none: no per-chunk bound. The first log line
    says so; refused without a dynamic policy."""
    from trainer.pipeline.runtime import graph_slots
    from trainer.schedule.registry import make_policy

    vp2 = ["--mock-data", "--num-layers", "8", "--pipeline-model-parallel-size", "4", "--global-batch-size", "32",
           "--micro-batch-size", "1", "--num-virtual-stages-per-pipeline-rank", "2", "--device", "cuda",
           "--transformer-impl", "local", *GRAPHS]

    def slots(argv: list[str]) -> list[tuple[int, ...]]:
        plan = _plan(argv, world_size=4)
        policies = [make_policy(plan.schedule.policy, plan.shape, s, **plan.schedule.policy_kwargs) for s in range(4)]
        return [graph_slots(p, plan.shape, s) for s, p in enumerate(policies)]

    zb = [*vp2, "--dpp-policy", "dpp-zb"]
    assert _plan(zb, world_size=4).schedule.policy_kwargs["chunk_caps"] == "interleaved"
    assert "--dpp-chunk-caps auto" in _plan(zb, world_size=4).schedule.log_text
    assert slots(zb) == [(8, 4)] * 4  # dpp-zb's held cap is stage 0's bound on every stage
    assert slots([*vp2, "--dpp-policy", "dpp"]) == [(8, 4), (8, 4), (7, 3), (5, 1)]  # each stage's own
    assert slots([*zb, "--dpp-chunk-caps", "none"]) == [(11, 11)] * 4
    assert slots([*vp2, "--dpp-policy", "dpp", "--dpp-chunk-caps", "none"]) == [(11, 11), (9, 9), (7, 7), (5, 5)]
    eager = [*CPU_PP2, "--device", "cpu", "--use-dpp", "--num-virtual-stages-per-pipeline-rank", "2"]
    assert "chunk_caps" not in _plan(eager).schedule.policy_kwargs
    assert _plan([*eager, "--dpp-chunk-caps", "interleaved"]).schedule.policy_kwargs["chunk_caps"] == "interleaved"
    assert "chunk_caps" not in _plan([*CPU_PP2, "--device", "cpu", "--use-dpp", "--dpp-chunk-caps",
                                      "interleaved"]).schedule.policy_kwargs  # one chunk: the stage's cap
    with pytest.raises(ConfigError, match="--dpp-chunk-caps=interleaved applies to --use-dpp"):
        _plan([*CPU_PP2, "--dpp-chunk-caps", "interleaved"])


def test_use_dpp_alone_picks_graphs_where_they_can_run(monkeypatch) -> None:
    """--use-dpp alone on CUDA: CUDA graphs and dpp-zb (the fastest measured), one op queued ahead;
    --dpp-eager turns them off; a layout the graph checks block runs eagerly and says why (no error),
    while --dpp-cuda-graphs on that layout stays an error."""
    from trainer.config import ConfigError
    auto = _plan([*CUDA_PP2, "--use-dpp"]).schedule
    assert (auto.cuda_graphs, auto.policy, auto.split_backward, auto.max_queued_ops) == (True, "dpp-zb", True, 1)
    assert auto.graphs_reason == AUTO_GRAPHS and auto.log_text.endswith(f"{AUTO_GRAPHS}; {FIT}")
    assert _plan([*CUDA_PP2, "--use-dpp", "--dpp-policy", "dpp"]).schedule.cuda_graphs  # an explicit policy too
    eager = _plan([*CUDA_PP2, "--use-dpp", "--dpp-eager"]).schedule
    assert (eager.cuda_graphs, eager.policy, eager.max_queued_ops, eager.graphs_reason) == \
        (False, "dpp", 0, "eager: --dpp-eager")
    # Checks that apply "with graphs" accept the graphs --use-dpp turned on.
    slots = _plan([*CUDA_PP2, "--use-dpp", "--hidden-dropout", "0", "--attention-dropout", "0",
                   "--dpp-recompute-slots", "1"]).schedule
    assert slots.cuda_graphs and slots.recompute_slots_of(0) == 1
    blocked = {
        "varlen": (["--variable-seq-lengths", "--mock-seq-len-dist", "lognormal:0.6", "--seq-length", "1024",
                    "--seq-length-divisible-by", "16", "--max-position-embeddings", "1024"], 2, "at most 32 sequence lengths"),
        "recompute+dropout": (["--recompute-activations"], 2, "no recompute with dropout"),
    }
    # Tensor parallelism, with and without sequence parallelism: the TP collectives are captured in the graphs.
    for sp in ([], ["--sequence-parallel"]):
        tp2 = _plan([*CUDA_PP2, "--use-dpp", "--tensor-model-parallel-size", "2", *sp], 4).schedule
        assert (tp2.cuda_graphs, tp2.policy, tp2.split_backward) == (True, "dpp-zb", True), sp
    for name, (extra, world, why) in blocked.items():
        schedule = _plan([*CUDA_PP2, "--use-dpp", *extra], world).schedule
        assert not schedule.cuda_graphs and schedule.policy == "dpp", name
        assert schedule.graphs_reason.startswith("eager: --dpp-cuda-graphs needs") and why in schedule.graphs_reason
        assert why in schedule.log_text and schedule.max_queued_ops == 0, name
        with pytest.raises(ConfigError, match=why):
            _plan([*CUDA_PP2, "--use-dpp", "--dpp-cuda-graphs", *extra], world)
    with pytest.raises(ConfigError, match="--dpp-cuda-graphs and --dpp-eager: give one"):
        _plan([*CUDA_PP2, "--use-dpp", "--dpp-cuda-graphs", "--dpp-eager"])
    with pytest.raises(ConfigError, match="--dpp-eager applies to --use-dpp"):
        _plan([*CUDA_PP2, "--dpp-eager"])
    with pytest.raises(ConfigError, match="--dpp-recompute-slots 1 needs CUDA graphs.*here eager: --dpp-eager"):
        _plan([*CUDA_PP2, "--use-dpp", "--dpp-eager", "--dpp-recompute-slots", "1"])
    # Without --use-dpp nothing changes: megatron-core's schedule, no graphs, no graphs reason.
    megatron = _plan(CUDA_PP2).schedule
    assert (megatron.engine, megatron.cuda_graphs, megatron.graphs_reason, megatron.log_text) == \
        ("megatron-core", False, "", "megatron-core")
    # Transformer Engine's layers (where it is installed, --transformer-impl auto picks them): the default
    # replays them from graphs with a split backward in fp32 and bf16 (tests/gpu/test_te_split_gpu.py), and
    # megatron-core's own graphs
    # run with TE's RNG tracker, turned on by itself as in Megatron-LM.
    import importlib.util

    import trainer.config.transformer_engine as te

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    monkeypatch.setattr(te, "import_problem", lambda module: None)  # as if it imported
    with_te = [a for a in CUDA_PP2 if a not in ("--transformer-impl", "local")]
    for precision in ([], ["--bf16"]):
        te_default = _plan([*with_te, "--use-dpp", *precision]).schedule
        assert te_default.cuda_graphs and te_default.policy == "dpp-zb", te_default.log_text
        assert _plan([*with_te, *GRAPHS, *precision]).schedule.cuda_graphs
    te_graphs = _plan([*with_te, "--cuda-graph-impl", "local"]).rng
    assert te_graphs.te_tracker and te_graphs.graph_safe and "Megatron-LM" in te_graphs.te_tracker_reason
    asked = _plan([*with_te, "--te-rng-tracker"]).rng
    assert (asked.te_tracker, asked.te_tracker_reason, asked.graph_safe) == (True, "--te-rng-tracker", False)
    assert _plan([*with_te, "--use-dpp"]).rng.graph_safe  # the runtime's slot graphs (its default with TE)
    local = _plan(CUDA_PP2).rng  # local layers, megatron's schedule, no graphs: megatron's own tracker
    assert (local.te_tracker, local.graph_safe) == (False, False)


def test_te_rng_tracker_is_refused_where_transformer_engine_cannot_run() -> None:
    with pytest.raises(ConfigError, match="--te-rng-tracker needs --device cuda"):
        parse_config(["--mock-data", "--device", "cpu", "--te-rng-tracker"], world_size=1)


def test_the_plan_holds_the_layer_split_and_the_links() -> None:
    plan = _plan(["--mock-data", "--num-layers", "16", "--pipeline-model-parallel-size", "4", "--device", "cpu",
                  "--decoder-first-pipeline-num-layers", "6", "--decoder-last-pipeline-num-layers", "2",
                  "--num-virtual-stages-per-pipeline-rank", "2", "--use-dpp", "--dpp-cap-factor", "2",
                  "--global-batch-size", "8", "--seq-length", "64", "--hidden-size", "64"], world_size=4)
    assert plan.layers.per_stage == (6, 4, 4, 2) and plan.layers.per_chunk == (3, 2, 2, 1)
    assert plan.layers.describe() == "6/4/4/2" and len(plan.layers.stage_layers()[0]) == 2
    assert (plan.num_microbatches, plan.data_parallel, plan.shape.num_chunks) == (8, 1, 2)
    assert plan.links.credits >= 4 and plan.links.shm_slot_bytes == 64 * 64 * 4



def test_the_plan_holds_a_half_layer_split() -> None:
    """--pipeline-stage-layers: per_stage keeps the halves, a split layer is listed on both its stages."""
    plan = _plan(["--mock-data", "--num-layers", "16", "--pipeline-model-parallel-size", "4", "--device", "cpu",
                  "--pipeline-stage-layers", "4.5,4,4,3.5", "--use-dpp", "--global-batch-size", "8"], world_size=4)
    layers = plan.layers
    assert layers.per_stage == (4.5, 4, 4, 3.5) and layers.per_chunk == (4.5, 4, 4, 3.5)
    assert layers.describe() == "4.5/4/4/3.5" and layers.splits_inside_layers
    assert layers.stage_layers() == [[[0, 1, 2, 3, 4]], [[4, 5, 6, 7, 8]], [[8, 9, 10, 11, 12]], [[12, 13, 14, 15]]]
    whole = _plan(["--mock-data", "--num-layers", "16", "--pipeline-model-parallel-size", "4", "--device", "cpu",
                   "--pipeline-stage-layers", "5,4,4,3", "--global-batch-size", "8"], world_size=4).layers
    assert whole.per_stage == (5, 4, 4, 3) and whole.describe() == "5/4/4/3" and not whole.splits_inside_layers
    assert whole.stage_layers()[0] == [[0, 1, 2, 3, 4]] and whole.stage_layers()[1] == [[5, 6, 7, 8]]

# ---- the layer split: one set of rules, one balanced_split ----------------------------------------
def _config_accepts(n: int, pp: int, vp: int, first: int | None, last: int | None) -> bool:
    parallel = ParallelConfig(pipeline_model_parallel_size=pp, num_virtual_stages_per_pipeline_rank=vp if vp > 1 else None,
                              decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last)
    return not _stage_split_problems(TrainConfig(model=ModelConfig(num_layers=n), parallel=parallel))


def test_every_split_the_rules_accept_sums_to_the_layers_and_the_trainer_accepts_it() -> None:
    """split_problems and the trainer's configuration checks agree on every layout (both ways), and an
    accepted split places every layer once (no 'eight 1s' for 12 layers on 8 stages)."""
    accepted = 0
    for n, pp, vp in itertools.product(range(1, 13), range(1, 7), (1, 2)):
        for first, last in itertools.product([None, *range(1, n + 1)], repeat=2):
            ok = not layer_split.split_problems(n, pp, vp, first, last)
            assert ok == _config_accepts(n, pp, vp, first, last), (n, pp, vp, first, last)
            if ok:
                accepted += 1
                counts = layer_split.layers_per_stage(n, pp, first, last)
                assert sum(counts) == n and all(c >= 1 and c % vp == 0 for c in counts), (n, pp, vp, first, last)
                placed = sorted(i for stage in layer_split.stage_layers(n, pp, vp, first, last) for c in stage for i in c)
                assert placed == list(range(n))
    assert accepted > 500
    with pytest.raises(ValueError, match="not divisible by --pipeline-model-parallel-size=8"):
        layer_split.layers_per_stage(12, 8)


def test_one_balanced_split_for_the_bench_the_simulator_and_the_advice() -> None:
    for n, pp, vp, head in itertools.product(range(4, 25), (2, 3, 4), (1, 2), (0.0, 1.0, 2.0, 3.5)):
        if n < pp * vp or n % vp:
            continue
        best = layer_split.balanced_split(layer_split.LayerCosts(n, head=head), pp, vp)
        assert sum(best.layers) == n and not layer_split.split_problems(n, pp, vp, best.first, best.last)
        flags = bench_balanced_split(n, pp, vp, head)
        assert (None if flags is None else flags) == (None if best.first is None and best.last is None
                                                     else (best.layers[0], best.layers[-1])), (n, pp, vp, head)
    # The tie-break keeps the split measured best: 5/4/4/3 over the equally costly 4/5/5/2.
    assert bench_balanced_split(16, 4, 1, 2.0) == (5, 3)
    assert layer_split.balanced_split(layer_split.LayerCosts(16, head=2.0), 4).layers == (5, 4, 4, 3)
