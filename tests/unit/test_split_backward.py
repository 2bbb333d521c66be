"""trainer.pipeline.split_backward on megatron-core's local linears (one process, gloo world of 1).

The reference is autograd through plain ``torch.nn.Linear`` layers holding the same weights: the
input gradient must come out of I, every linear weight gradient out of W (and only then), biases
during I, and the store must be empty afterwards. Refusals name what they refuse.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from trainer.pipeline.split_backward import (
    SplitBackward,
    WeightGradStore,
    install_split_backward,
    split_backward_problems,
)


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group: megatron's linears reduce over their TP group even at TP=1."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def _megatron_pair(group, allreduce_dgrad: bool = False):
    """ColumnParallelLinear(8 -> 6, bias) then RowParallelLinear(6 -> 4, bias), as in an MLP."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    config = ModelParallelConfig(use_cpu_initialization=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        col = ColumnParallelLinear(8, 6, config=config, init_method=torch.nn.init.normal_, bias=True,
                                   tp_group=group)
        row = RowParallelLinear(6, 4, config=config, init_method=torch.nn.init.normal_, bias=True,
                                input_is_parallel=True, skip_bias_add=False, tp_group=group)
        with torch.no_grad():
            col.bias.normal_()
            row.bias.normal_()
    # At TP=1 megatron skips the dgrad all-reduce; forcing it runs the TP code path (a no-op sum).
    col.allreduce_dgrad = allreduce_dgrad
    return torch.nn.Sequential(col, row)


def _run(model, x):
    col, row = model
    hidden, _ = col(x)
    out, _ = row(torch.nn.functional.gelu(hidden))
    return out


def _reference(model):
    col, row = model
    ref = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    with torch.no_grad():
        for plain, megatron in zip(ref, (col, row), strict=True):
            plain.weight.copy_(megatron.weight)
            plain.bias.copy_(megatron.bias)
    return ref


def _reference_grads(model, x, grad_out):
    ref = _reference(model)
    xr = x.detach().clone().requires_grad_(True)
    out = ref[1](torch.nn.functional.gelu(ref[0](xr)))
    out.backward(grad_out)
    return xr.grad, [lin.weight.grad for lin in ref], [lin.bias.grad for lin in ref], out.detach()


@pytest.mark.parametrize("allreduce_dgrad", [False, True])
def test_i_gives_input_grad_and_w_gives_weight_grads_like_autograd(group, allreduce_dgrad) -> None:
    model = _megatron_pair(group, allreduce_dgrad)
    x = torch.randn(5, 3, 8)
    grad_out = torch.randn(5, 3, 4)
    ref_x, ref_w, ref_b, ref_out = _reference_grads(model, x, grad_out)

    split = install_split_backward([model])
    xs = x.clone().requires_grad_(True)
    out = _run(model, xs)
    torch.testing.assert_close(out.detach(), ref_out)
    with split.capture(("m0", 0)) as store:
        out.backward(grad_out)
    # I: the input gradient and the biases, no linear weight gradient yet.
    torch.testing.assert_close(xs.grad, ref_x)
    assert [lin.weight.grad for lin in model] == [None, None]
    for lin, expected in zip(model, ref_b, strict=True):
        torch.testing.assert_close(lin.bias.grad, expected)
    assert len(store) == 2 and split.pending() == [("m0", 0)]

    assert split.replay(("m0", 0)) == 2
    for lin, expected in zip(model, ref_w, strict=True):
        torch.testing.assert_close(lin.weight.grad, expected)
    assert len(store) == 0 and split.pending() == []


@pytest.mark.parametrize("sequence_parallel_input", ["keep", "regather"])
def test_sequence_parallel_defers_the_gemm_on_the_gathered_input(group, sequence_parallel_input) -> None:
    """--sequence-parallel: the column-parallel linear multiplies its input all-gathered over TP and
    reduce-scatters its input gradient; its deferred GEMM keeps the gathered input, or keeps the local
    shard and gathers it again in W. A one-rank TP group runs both collectives (identities here); the
    dist tier (test_dpp_equivalence.py::gpt-pp2-tp2-sp*-dpp-zb) runs them over two ranks."""
    model = _megatron_pair(group)
    model[0].sequence_parallel = True  # megatron's column-parallel forward passes it to _forward_impl
    x, grad_out = torch.randn(5, 3, 8), torch.randn(5, 3, 4)
    ref_x, ref_w, _, _ = _reference_grads(model, x, grad_out)
    split = install_split_backward([model], sequence_parallel_input=sequence_parallel_input)
    xs = x.clone().requires_grad_(True)
    with split.capture(0) as store:
        _run(model, xs).backward(grad_out)
    torch.testing.assert_close(xs.grad, ref_x)
    column, row = store.entries[1], store.entries[0]  # the backward reaches the row-parallel linear first
    assert column.weight is model[0].weight and row.gather_group is None
    assert (column.gather_group is group) == (sequence_parallel_input == "regather")
    split.replay(0)
    for lin, expected in zip(model, ref_w, strict=True):
        torch.testing.assert_close(lin.weight.grad, expected)


def test_w_accumulates_into_main_grad_over_microbatches(group) -> None:
    """Under megatron DDP the weight has main_grad; W adds there (twice = two microbatches)."""
    model = _megatron_pair(group)
    x, grad_out = torch.randn(5, 3, 8), torch.randn(5, 3, 4)
    _, ref_w, _, _ = _reference_grads(model, x, grad_out)
    for lin in model:
        lin.weight.main_grad = torch.zeros_like(lin.weight, dtype=torch.float32)
    split = install_split_backward([model])
    for m in range(2):
        with split.capture(m):
            _run(model, x.clone().requires_grad_(True)).backward(grad_out)
    for m in range(2):
        split.replay(m)
    for lin, expected in zip(model, ref_w, strict=True):
        torch.testing.assert_close(lin.weight.main_grad, 2 * expected)
        assert lin.weight.grad is None


def test_without_an_open_store_weight_grads_are_immediate(group) -> None:
    """Evaluation, or a backward outside I: exactly megatron's behaviour, nothing deferred."""
    model = _megatron_pair(group)
    x, grad_out = torch.randn(5, 3, 8), torch.randn(5, 3, 4)
    ref_x, ref_w, _, _ = _reference_grads(model, x, grad_out)
    split = install_split_backward([model])
    xs = x.clone().requires_grad_(True)
    _run(model, xs).backward(grad_out)
    torch.testing.assert_close(xs.grad, ref_x)
    for lin, expected in zip(model, ref_w, strict=True):
        torch.testing.assert_close(lin.weight.grad, expected)
    assert split.pending() == []


def test_frozen_weight_takes_megatrons_own_path(group) -> None:
    model = _megatron_pair(group)
    model[0].weight.requires_grad_(False)
    split = install_split_backward([model])
    xs = torch.randn(5, 3, 8, requires_grad=True)
    with split.capture(0) as store:
        _run(model, xs).sum().backward()
    assert len(store) == 1  # only the trainable row-parallel weight was deferred
    split.replay(0)
    assert model[0].weight.grad is None and model[1].weight.grad is not None


def test_refusals_name_every_unsupported_feature(group) -> None:
    model = _megatron_pair(group)
    model[1].gradient_accumulation_fusion = True
    chunk = SimpleNamespace(modules=model.modules, ddp_config=SimpleNamespace(overlap_grad_reduce=True))
    with pytest.raises(ValueError) as err:
        install_split_backward([chunk])
    message = str(err.value)
    for word in ("gradient_accumulation_fusion", "overlap_grad_reduce"):
        assert word in message
    assert "_forward_impl" not in vars(model[0])  # nothing patched when refused
    # Overlapped reduction is fine once the runtime, not megatron's hooks, starts it (trainer/model/ddp.py).
    model[1].gradient_accumulation_fusion = False
    chunk.reduction_launched_by_runtime = True
    assert split_backward_problems([chunk]) == []


def test_transformer_engine_and_empty_models_are_refused(group) -> None:
    class TELayerNormColumnParallelLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 4))

    assert any("Transformer Engine" in p and "TELayerNormColumnParallelLinear" in p
               for p in split_backward_problems([torch.nn.Sequential(TELayerNormColumnParallelLinear())]))
    # A TE norm has no GEMM weight to defer: megatron-core builds the block's final norm from TE wherever TE is
    # installed, even with the local spec, and split backward runs (a stand-in placed and named as TE's RMSNorm).
    te_norm = type("RMSNorm", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch.module.rmsnorm"})
    norm = te_norm()
    norm.weight = torch.nn.Parameter(torch.ones(4))
    assert split_backward_problems([torch.nn.Sequential(_megatron_pair(group), norm)]) == []
    with pytest.raises(ValueError, match="no ColumnParallelLinear/RowParallelLinear"):
        install_split_backward([torch.nn.Linear(2, 2)])


def test_unknown_active_forward_options_and_double_install_are_refused(group) -> None:
    model = _megatron_pair(group)
    install_split_backward([model])
    with pytest.raises(ValueError, match="already has a per-instance _forward_impl"):
        install_split_backward([model])
    col = model[0]
    x = torch.randn(2, 1, 8, requires_grad=True)
    # Options megatron passes switched off are accepted; one we do not know, switched on, is not.
    col._forward_impl(input=x, weight=col.weight, bias=None, gtp_remat_size=1, future_flag=None,
                      output_dtype=x.dtype)
    with pytest.raises(ValueError, match="output_dtype=torch.bfloat16"):
        col._forward_impl(input=x, weight=col.weight, bias=None, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="future_flag=2"):
        col._forward_impl(input=x, weight=col.weight, bias=None, future_flag=2)
    with pytest.raises(ValueError, match="sequence_parallel=True with allreduce_dgrad=True"):
        col._forward_impl(input=x, weight=col.weight, bias=None, sequence_parallel=True, allreduce_dgrad=True)


def test_store_lifecycle_errors() -> None:
    with pytest.raises(ValueError, match="sequence_parallel_input='gather'"):
        SplitBackward("gather")
    split = SplitBackward()
    with split.capture(1), pytest.raises(RuntimeError, match="already open"), split.capture(2):
        pass
    assert split.active is None
    with pytest.raises(RuntimeError, match="its I did not run"):
        split.replay(3)


def test_runtime_refuses_a_split_policy_without_the_store() -> None:
    from trainer.launch.topology import Topology
    from trainer.pipeline import DppContext, forward_backward_dpp
    from trainer.schedule.core import PipelineShape
    from trainer.schedule.registry import make_policy

    config = SimpleNamespace(no_sync_func=None, grad_sync_func=None, finalize_model_grads_func=None,
                             grad_scale_func=None, calculate_per_token_loss=False,
                             deallocate_pipeline_outputs=True, enable_autocast=False)
    chunk = torch.nn.Linear(1, 1)
    chunk.config = config
    context = DppContext(topology=Topology(world_size=1, rank=0),
                         policy=make_policy("dpp-zb", PipelineShape(1, 2), 0, split_first_stage=True), links=None,
                         microbatch_data=lambda m, c: None)
    with pytest.raises(ValueError, match="'dpp-zb' splits the backward"):
        forward_backward_dpp(forward_step_func=None, data_iterator=None, model=[chunk], num_microbatches=2,
                             seq_length=1, micro_batch_size=1, dpp_context=context)


def test_config_names_every_bad_policy_combination() -> None:
    from trainer.config import ConfigError, parse_config, resolve_plan

    with pytest.raises(ConfigError) as err:
        parse_config(["--dpp-policy", "dpp-zb"], world_size=1)
    assert "--dpp-policy=dpp-zb needs --use-dpp" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config(["--dpp-policy", "zb-h2"], world_size=1)
    assert "--dpp-policy='zb-h2' must be one of auto, dpp, dpp-zb, zb-h1" in str(err.value)
    with pytest.raises(ConfigError, match="--dpp-max-inflight=3 applies to --dpp-policy dpp/dpp-zb"):
        parse_config(["--dpp-policy", "zb-h1", "--dpp-max-inflight", "3"], world_size=1)
    # Checks that need the device and the layout come in one message too.
    with pytest.raises(ConfigError) as err:
        parse_config(["--mock-data", "--dpp-policy", "zb-h1", "--device", "cuda", "--num-layers", "4",
                      "--transformer-impl", "transformer_engine",
                      "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                      "--global-batch-size", "4"], world_size=2)
    problems = err.value.problems
    assert any("--transformer-impl transformer_engine needs Transformer Engine, which does not import here" in p
               for p in problems)
    assert any("one model chunk per stage" in p for p in problems)
    assert any("add --use-dpp" in p for p in problems)
    cfg = parse_config(["--mock-data", "--use-dpp", "--dpp-policy", "dpp-zb", "--device", "cuda", "--transformer-impl", "local"],
                       world_size=1)
    assert cfg.parallel.dpp_policy == "dpp-zb"
    default = parse_config(["--mock-data"], world_size=1)
    assert default.parallel.dpp_policy == "auto" and resolve_plan(default, 1).schedule.dpp_policy == "dpp"


def test_auto_policy_is_dpp_zb_with_graphs_where_split_backward_is_possible(monkeypatch) -> None:
    """--dpp-policy auto (the default): dpp-zb with --dpp-cuda-graphs (measured faster at equal memory
    on 4xH100, docs/benchmarks.md), dpp for eager runs and wherever split backward is ruled out -- never an error
    for a run that did not ask for dpp-zb."""
    import importlib.util

    from trainer.config import ConfigError, parse_config, resolve_dpp_policy, resolve_plan

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    base = ["--mock-data", "--use-dpp", "--device", "cuda", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    graphed = parse_config([*base, "--dpp-cuda-graphs"], world_size=2)
    schedule = resolve_plan(graphed, 2).schedule
    assert schedule.dpp_policy == "dpp-zb" and "auto: with CUDA graphs" in resolve_dpp_policy(graphed)[1]
    assert schedule.policy == "dpp-zb" and schedule.policy_kwargs["fill_transit"] is True
    assert resolve_plan(parse_config(base, world_size=2), 2).schedule.dpp_policy == "dpp-zb"  # graphs by default
    eager = parse_config([*base, "--dpp-eager"], world_size=2)
    assert resolve_plan(eager, 2).schedule.dpp_policy == "dpp" and "without CUDA graphs" in resolve_dpp_policy(eager)[1]
    assert resolve_plan(eager, 2).schedule.policy == "dpp"
    # Transformer Engine's layers split under graphs too (test_te_split_backward_keeps_the_default_graphs)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    import trainer.config.transformer_engine as te

    monkeypatch.setattr(te, "import_problem", lambda module: None)  # as if it imported
    with_te = parse_config([*base, "--dpp-cuda-graphs", "--transformer-impl", "transformer_engine"], world_size=2)
    assert resolve_dpp_policy(with_te)[0] == "dpp-zb"
    # --no-dpp-fill-transit only where dpp-zb runs
    with pytest.raises(ConfigError, match="--no-dpp-fill-transit applies to --use-dpp with dpp-zb.*without CUDA graphs"):
        parse_config([*base, "--dpp-eager", "--no-dpp-fill-transit"], world_size=2)
    assert not parse_config([*base, "--dpp-cuda-graphs", "--transformer-impl", "local", "--no-dpp-fill-transit"],
                            world_size=2).parallel.dpp_fill_transit
    # --no-dpp-land-forwards only where dpp-zb runs with two or more chunks per stage, landing looked at
    vp2 = [*base, "--dpp-cuda-graphs", "--transformer-impl", "local", "--num-virtual-stages-per-pipeline-rank", "2",
           "--global-batch-size", "4"]
    assert "land_forwards" not in resolve_plan(parse_config(vp2, world_size=2), 2).schedule.policy_kwargs
    off = resolve_plan(parse_config([*vp2, "--no-dpp-land-forwards"], world_size=2), 2).schedule
    assert off.policy == "dpp-zb" and off.policy_kwargs["land_forwards"] is False
    for refused in ([*base, "--dpp-cuda-graphs", "--transformer-impl", "local"], [*vp2, "--dpp-policy", "dpp"],
                    [*vp2, "--no-dpp-fill-transit"]):
        with pytest.raises(ConfigError, match="--no-dpp-land-forwards applies to --use-dpp with dpp-zb, two or more"):
            parse_config([*refused, "--no-dpp-land-forwards"], world_size=2)
    # dpp-zb's weight order: youngest first at v > 1 under graphs with lazy operand copies (a W right after its own
    # I copies nothing), else the policy's default; --dpp-weight-order sets it, for dpp-zb only
    kwargs = resolve_plan(parse_config(vp2, world_size=2), 2).schedule.policy_kwargs
    assert kwargs["weight_order"] == "youngest"
    eager_vp2 = [*(f for f in vp2 if f != "--dpp-cuda-graphs"), "--dpp-eager", "--dpp-policy", "dpp-zb"]
    for flags in ([*vp2, "--dpp-graph-operand-copies", "in-i"], eager_vp2):
        plan = resolve_plan(parse_config(flags, world_size=2), 2).schedule
        assert plan.policy == "dpp-zb" and "weight_order" not in plan.policy_kwargs, flags
    assert "weight_order" not in resolve_plan(parse_config([*base, "--transformer-impl", "local"], world_size=2),
                                              2).schedule.policy_kwargs  # v = 1: the policy's youngest
    assert resolve_plan(parse_config([*vp2, "--dpp-weight-order", "oldest"], world_size=2),
                        2).schedule.policy_kwargs["weight_order"] == "oldest"
    with pytest.raises(ConfigError, match="--dpp-weight-order=oldest applies to --use-dpp with dpp-zb"):
        parse_config([*vp2, "--dpp-policy", "dpp", "--dpp-weight-order", "oldest"], world_size=2)
    # --dpp-graph-operand-copies only for a split backward under the slot graphs
    local = [*base, "--transformer-impl", "local"]
    assert resolve_plan(parse_config(local, world_size=2), 2).schedule.operand_copies == "auto"
    for mode in ("lazy", "in-i"):
        assert resolve_plan(parse_config([*local, "--dpp-graph-operand-copies", mode], world_size=2),
                            2).schedule.operand_copies == mode
        assert resolve_plan(parse_config([*local, "--dpp-policy", "zb-h1", "--dpp-graph-operand-copies", mode],
                                         world_size=2), 2).schedule.operand_copies == mode
    for refused, why in (([*local, "--dpp-eager"], "graphs off"), ([*local, "--dpp-policy", "dpp"], "graphs on")):
        with pytest.raises(ConfigError, match=r"--dpp-graph-operand-copies=in-i applies to a split backward "
                                              rf"\(--dpp-policy dpp-zb or zb-h1\) under the CUDA graph slots; .*{why}"):
            parse_config([*refused, "--dpp-graph-operand-copies", "in-i"], world_size=2)
    with pytest.raises(ConfigError, match="--dpp-graph-operand-copies='never' must be one of auto, lazy, in-i"):
        parse_config([*local, "--dpp-graph-operand-copies", "never"], world_size=2)
    # --dpp-graph-evacuation-sets: auto = the pipeline size at two or more chunks, two at one chunk (at most the
    # pipeline size), where operands are left in the pool; slots = none shared
    def sets(*flags: str, pp: int = 2) -> int | None:
        shape = ["--pipeline-model-parallel-size", str(pp), "--num-layers", str(2 * pp)]
        return resolve_plan(parse_config([*local, *shape, *flags], world_size=pp), pp).schedule.evacuation_sets

    assert sets() == 2 and sets("--dpp-graph-evacuation-sets", "3") == 3
    assert sets(pp=4) == 2 and sets("--dpp-graph-evacuation-sets", "3", pp=4) == 3
    assert sets("--dpp-policy", "zb-h1", pp=4) == 4  # ZB-H1 holds every W behind later I's: p sets
    vp = ("--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8")
    assert sets(*vp, pp=4) == 4 and sets(*vp) == 2
    assert sets("--dpp-graph-evacuation-sets", "slots") is None and sets("--dpp-graph-operand-copies", "in-i") is None
    assert sets("--dpp-policy", "zb-h1") == 2 and sets("--dpp-policy", "dpp") is None
    for value in ("0", "many"):
        with pytest.raises(ConfigError, match=f"--dpp-graph-evacuation-sets='{value}' must be auto, slots or a number"):
            parse_config([*local, "--dpp-graph-evacuation-sets", value], world_size=2)
    with pytest.raises(ConfigError, match=r"--dpp-graph-evacuation-sets=1 applies to a split backward under the CUDA "
                                          r"graph slots .*operand copies in-i"):
        parse_config([*local, "--dpp-graph-operand-copies", "in-i", "--dpp-graph-evacuation-sets", "1"], world_size=2)


def test_te_split_backward_keeps_the_default_graphs(monkeypatch) -> None:
    """dpp-zb with Transformer Engine's layers (here picked by --transformer-impl auto, as where TE is
    installed) replays from --use-dpp's default graphs, as with megatron-core's local layers."""
    import importlib.util

    import trainer.config.transformer_engine as te
    from trainer.config import parse_config, resolve_plan

    args = ["--mock-data", "--use-dpp", "--dpp-policy", "dpp-zb", "--device", "cuda", "--pipeline-model-parallel-size",
            "2", "--num-layers", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    local = resolve_plan(parse_config(args, world_size=2), 2).schedule  # auto = local without TE: graphed
    assert (local.dpp_policy, local.cuda_graphs) == ("dpp-zb", True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    monkeypatch.setattr(te, "import_problem", lambda module: None)  # as if it imported
    schedule = resolve_plan(parse_config(args, world_size=2), 2).schedule
    assert (schedule.dpp_policy, schedule.cuda_graphs) == ("dpp-zb", True)
    assert parse_config([*args, "--dpp-cuda-graphs"], world_size=2).parallel.dpp_cuda_graphs


def test_the_store_keeps_the_incoming_gradient_itself_so_the_runtime_must_copy_it(group) -> None:
    """Why dpp.py's I copies a received gradient out of its transport slot before the backward:
    autograd hands the last linear the caller's tensor unchanged, and W reads it much later."""
    model = _megatron_pair(group)
    split = install_split_backward([model])
    grad_out = torch.randn(5, 3, 4)
    with split.capture(0) as store:
        _run(model, torch.randn(5, 3, 8, requires_grad=True)).backward(grad_out)
    assert any(entry.grad_output.data_ptr() == grad_out.data_ptr() for entry in store.entries)
    split.replay(0)


def _w_grads(model, split, store_for, x, grad_out) -> tuple[list[torch.Tensor], WeightGradStore]:
    """Weight gradients from an I into ``store_for()`` (opened with capture_into) and its replay."""
    for lin in model:
        lin.weight.grad = None
    store = store_for()
    with split.capture_into(store):
        _run(model, x.clone().requires_grad_(True)).backward(grad_out)
    kept = list(store.entries)
    store.replay()
    return [lin.weight.grad.clone() for lin in model], kept


def _planned_pair(group):
    """A megatron linear pair with split backward, an input and output gradient, the plain store's weight
    gradients, and the slot plan the warm-up would make (what was alive before the backward: kept)."""
    from trainer.pipeline.graph_operands import plan_operands

    model = _megatron_pair(group)
    split = install_split_backward([model])
    x, grad_out = torch.randn(5, 3, 8), torch.randn(5, 3, 4)
    want, plain = _w_grads(model, split, WeightGradStore, x, grad_out)
    before = {grad_out.data_ptr()} | {e.input.untyped_storage().data_ptr() for e in plain}
    return model, split, x, grad_out, want, plan_operands(plain, lambda t: t.untyped_storage().data_ptr() in before)


def test_a_graph_slots_store_keeps_copies_in_its_own_buffers_and_gives_the_same_grads(group) -> None:
    """StaticOperandStore (the store a CUDA graph slot's I is captured with), planned as the warm-up plans
    it: every output gradient the backward allocated is copied into the slot's buffer -- never the
    tensor autograd handed over, which the shared backward pool reuses -- while the inputs the forward
    saved and the incoming gradient (alive before the backward) are read where they are; W computes
    what the plain store computes. A shorter (variable) length uses the leading rows of the buffers."""
    from trainer.pipeline.graph_operands import StaticOperandStore, check_kept

    model, split, x, grad_out, want, plan = _planned_pair(group)
    # the row-parallel linear's output gradient is the incoming one itself (kept); the column one's is new
    assert plan.copies == ((), (1,)) and [shape for shape, _ in plan.buffers] == [torch.Size([5, 3, 6])]
    buffers = [torch.full(shape, float("nan")) for shape, _ in plan.buffers]
    got, kept = _w_grads(model, split, lambda: StaticOperandStore(buffers, plan.copies), x, grad_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert kept[1].grad_output.data_ptr() == buffers[0].data_ptr() and kept[0].grad_output is not None
    short_want, _ = _w_grads(model, split, WeightGradStore, x[:2], grad_out[:2])
    short_got, _ = _w_grads(model, split, lambda: StaticOperandStore(buffers, plan.copies), x[:2], grad_out[:2])
    for g, w in zip(short_got, short_want, strict=True):
        torch.testing.assert_close(g, w)
    store = StaticOperandStore(buffers, plan.copies)
    with split.capture_into(store):
        _run(model, x.clone().requires_grad_(True)).backward(grad_out)
    check_kept(store, lambda t: True, 5)  # all planned buffers filled, nothing kept that the backward made
    with pytest.raises(RuntimeError, match=r"at length 5, weight GEMM 1's operand 2 \(5, 3, 4\) was allocated by "
                                           r"the captured backward but the warm-up found it alive"):
        check_kept(store, lambda t: t.data_ptr() != grad_out.data_ptr(), 5)
    store.replay()


def test_a_deferred_slot_store_leaves_operands_in_place_until_the_evacuation_copies_them(group) -> None:
    """StaticOperandStore(deferred=True), as a slot's I is captured when the stage tracks its backward
    pool: I copies nothing; the direct W reads the operands where the backward made them, the evacuation
    (copy_out_to) fills the slot's buffers, and the W after it reads those. Both give the plain store's
    gradients, and each entry runs once."""
    from trainer.pipeline.graph_operands import StaticOperandStore, check_kept, copies_wait

    model, split, x, grad_out, want, plan = _planned_pair(group)
    buffers = plan.allocate(torch.device("cpu"))  # what capture_slot sizes the slot's buffers with
    assert [(b.shape, b.dtype) for b in buffers] == list(plan.buffers)
    assert copies_wait(plan) and copies_wait(plan, "lazy") and not copies_wait(plan, "in-i")
    assert not copies_wait(dataclasses.replace(plan, copies=((), ())), "lazy")  # nothing to copy
    with pytest.raises(ValueError, match="operand copies 'later': one of auto, lazy, in-i"):
        copies_wait(plan, "later")
    buffers = [torch.full(shape, float("nan")) for shape, _ in plan.buffers]

    def i_step() -> StaticOperandStore:
        for lin in model:
            lin.weight.grad = None
        store = StaticOperandStore([], plan.copies, deferred=True)
        with split.capture_into(store):
            _run(model, x.clone().requires_grad_(True)).backward(grad_out)
        check_kept(store, lambda t: True, 5)
        return store

    store = i_step()
    assert torch.isnan(buffers[0]).all()  # I copied nothing
    assert store.entries[1].grad_output.data_ptr() != buffers[0].data_ptr()
    assert store.reading(buffers)[1].grad_output.data_ptr() == buffers[0].data_ptr()
    store.replay()  # the direct W
    for lin, w in zip(model, want, strict=True):
        torch.testing.assert_close(lin.weight.grad, w)

    store = i_step()
    assert store.copy_out_to(buffers) == 1 and not torch.isnan(buffers[0]).any()
    store.entries.clear()  # the evacuated slot replays the W that reads the buffers instead
    WeightGradStore(store.reading(buffers)).replay()
    for lin, w in zip(model, want, strict=True):
        torch.testing.assert_close(lin.weight.grad, w)


def test_the_backward_pool_state_evacuates_only_when_another_backward_comes_first() -> None:
    """BackwardPoolState: a slot's W right after its I reads the pool (no copy); any other backward graph
    of the stage first -- another slot's I, a whole backward, another slot's W -- evacuates it into a free
    shared set, which its W reads and frees again."""
    from trainer.pipeline.graph_operands import BackwardPoolState, EvacuationSets

    log: list[str] = []
    pool = BackwardPoolState()
    pool.share(EvacuationSets(2, [], torch.device("cpu")))

    def graph(text: str) -> SimpleNamespace:
        return SimpleNamespace(replay=lambda: log.append(text))

    def slot(name: str, copies: bool = True) -> SimpleNamespace:
        ids = pool.shared if copies else []
        return SimpleNamespace(name=name, evacs={k: graph(f"E{name}{k}") for k in ids},
                               wgts={k: graph(f"W{name}{k}") for k in ids}, wgt_direct=graph(f"Wdirect{name}"))

    def i_step(pair) -> None:
        pool.before_backward(pair)
        log.append(f"I{pair.name}")
        pool.after_i(pair)

    a, b, whole = slot("a"), slot("b"), slot("B", copies=False)
    i_step(a)
    assert pool.replay_w(a) == "direct"
    assert log == ["Ia", "Wdirecta"] and (pool.direct, pool.evacuated, pool.state.holder) == (1, 0, None)
    log.clear()
    i_step(a)
    i_step(b)  # b's I would overwrite a's operands: a goes to set 0 first
    assert pool.replay_w(a) == "set"  # a reads set 0; b's operands leave the pool first (a's W allocates there)
    assert pool.replay_w(b) == "set"
    assert log == ["Ia", "Ea0", "Ib", "Eb1", "Wa0", "Wb1"]
    assert (pool.direct, pool.evacuated, pool.state.occupant) == (1, 2, {})
    log.clear()
    i_step(a)
    i_step(whole)  # a whole backward (nothing to copy) evacuates too, and holds nothing itself
    assert log == ["Ia", "Ea0", "IB"] and pool.state.holder is None and pool.state.occupant == {0: id(a)}
    assert pool.replay_w(a) == "set" and pool.state.occupant == {}
    log.clear()


def test_with_every_evacuation_set_taken_the_holder_runs_its_w_at_once() -> None:
    """Two shared sets and four slots whose W's all wait: the third slot's operands find no free set, so
    its direct W replays before the backward that would overwrite them, and its W in the schedule's order
    replays nothing; likewise the fourth's before a W reading a set. Each W runs exactly once; a W whose
    operands are nowhere fails."""
    from trainer.pipeline.graph_operands import BackwardPoolState, EvacuationSets

    log: list[str] = []
    pool = BackwardPoolState()
    pool.share(EvacuationSets(2, [], torch.device("cpu")))

    def slot(name: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, evacs={k: SimpleNamespace(replay=lambda k=k: log.append(f"E{name}{k}"))
                                                 for k in pool.shared},
                               wgts={k: SimpleNamespace(replay=lambda k=k: log.append(f"W{name}{k}"))
                                     for k in pool.shared},
                               wgt_direct=SimpleNamespace(replay=lambda: log.append(f"Wdirect{name}")))

    a, b, c, d = (slot(n) for n in "abcd")
    for pair in (a, b, c, d):
        pool.before_backward(pair)
        log.append(f"I{pair.name}")
        pool.after_i(pair)
    # a -> set 0, b -> set 1, then c finds none free: its W runs before d's I
    assert log == ["Ia", "Ea0", "Ib", "Eb1", "Ic", "Wdirectc", "Id"] and pool.early == 1
    # b's W reads set 1, which is not free until it has: d (in the pool) runs its W first
    assert [pool.replay_w(p) for p in (c, b, d, a)] == ["early", "set", "early", "set"]
    assert log[7:] == ["Wdirectd", "Wb1", "Wa0"] and pool.state.occupant == {}
    assert (pool.direct, pool.evacuated, pool.early) == (0, 2, 2)
    assert sorted(e for e in log if e.startswith("W")) == ["Wa0", "Wb1", "Wdirectc", "Wdirectd"]
    with pytest.raises(RuntimeError, match="a W whose operands are neither in the backward pool nor in an evacuation"):
        pool.replay_w(a)


def test_evacuation_sets_lay_every_chunks_plan_out_in_the_largest(group) -> None:
    """EvacuationSets: one flat buffer per set, as large as the largest plan; a plan's buffers are aligned
    views of it (a smaller chunk's plan uses its start). A store evacuates into any set and its W reads
    that set: the plain store's gradients."""
    from trainer.pipeline.graph_operands import EvacuationSets, OperandPlan, StaticOperandStore, check_kept

    model, split, x, grad_out, want, plan = _planned_pair(group)
    big = OperandPlan(((0, 1),), ((torch.Size([3]), torch.float16), (torch.Size([1000]), torch.float32)))
    assert big.nbytes() == 512 + 4096 and plan.nbytes() == 512  # each buffer from a 512-byte boundary
    sets = EvacuationSets(2, [plan, big], torch.device("cpu"))
    assert len(sets) == 2 and sets.nbytes == big.nbytes()
    views = sets.views(1, plan)
    assert [(v.shape, v.dtype) for v in views] == list(plan.buffers)
    assert views[0].untyped_storage().data_ptr() == sets.arenas[1].data_ptr()
    half, floats = sets.views(0, big)
    assert half.dtype == torch.float16 and floats.data_ptr() == sets.arenas[0].data_ptr() + 512
    with pytest.raises(ValueError, match="a plan needs 4608"):
        EvacuationSets(1, [plan], torch.device("cpu")).views(0, big)
    for lin in model:
        lin.weight.grad = None
    store = StaticOperandStore([], plan.copies, deferred=True)
    with split.capture_into(store):
        _run(model, x.clone().requires_grad_(True)).backward(grad_out)
    check_kept(store, lambda t: True, 5)
    assert store.copy_out_to(views) == 1
    with pytest.raises(RuntimeError, match="1 operand\\(s\\) to evacuate into a set of 0 buffer"):
        store.copy_out_to([])
    store.entries.clear()  # as after an evacuation: the W reads the set
    WeightGradStore(store.reading(views)).replay()
    for lin, w in zip(model, want, strict=True):
        torch.testing.assert_close(lin.weight.grad, w)


def test_a_graph_slots_store_refuses_gradients_its_buffers_do_not_fit(group) -> None:
    from trainer.pipeline.graph_operands import StaticOperandStore

    model = _megatron_pair(group)
    split = install_split_backward([model])
    x, grad_out = torch.randn(5, 3, 8), torch.randn(5, 3, 4)
    with pytest.raises(RuntimeError, match=r"weight GEMM 1 deferred, but the slot was planned for 0"):
        _w_grads(model, split, lambda: StaticOperandStore([], ()), x, grad_out)
    assert split.active is None
    with pytest.raises(RuntimeError, match=r"weight GEMM 1's operand 2 needs buffer 1, but the slot has 0"):
        _w_grads(model, split, lambda: StaticOperandStore([], ((1,), (1,))), x, grad_out)
    wrong = [torch.empty(5, 2, 4), torch.empty(5, 3, 6)]  # batch 2, not 3: only the sequence may be shorter
    with pytest.raises(RuntimeError, match=r"weight GEMM 1's operand 2 is \(5, 3, 4\).*buffer \(5, 2, 4\)"):
        _w_grads(model, split, lambda: StaticOperandStore(wrong, ((1,), (1,))), x, grad_out)


def test_capture_into_refuses_a_second_open_store() -> None:
    split = SplitBackward()
    with split.capture(1), pytest.raises(RuntimeError, match="already open while opening 'a graph'"):
        with split.capture_into(WeightGradStore(), "a graph"):
            pass
    assert split.active is None and split.pending() == [1]
