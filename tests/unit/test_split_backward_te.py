"""trainer.pipeline.split_backward_te: Transformer Engine's linears under the runtime's I and W steps.

Transformer Engine needs CUDA and is not installed on the CPU machines, so its linears are stand-ins
here (a mock, for the hardware's absence): classes defined *as* TE's (``__module__`` and name of
``te.Linear`` and ``te.LayerNormLinear``, and megatron-core's subclass name) whose autograd keeps TE
2.18's side of the deferral contract -- ``te.Linear`` binds ``self.wgrad_store`` at the forward only
when ``delay_wgrad_compute()`` is true, ``te.LayerNormLinear`` always and asks at the backward; a
deferring backward ``put``s ``([input, grad_output], gemm)`` with ``gemm -> (weight_grad, bias_grad)``
and returns no weight or (GEMM-fused) bias gradient; TE's own store is a FIFO queue per module
(``transformer_engine/pytorch/module/_common.py``). The real layers run in tests/gpu/test_te_split_gpu.py.

The reference is plain autograd through the same weights; W steps run youngest first (dpp-zb's order
at one chunk per stage), which TE's FIFO could not serve.
"""

from __future__ import annotations

import queue
import warnings

import pytest
import torch
import torch.distributed as dist

from trainer.pipeline.graph_operands import StaticOperandStore, check_kept, copies_wait, plan_operands
from trainer.pipeline.split_backward import (
    WeightGradStore,
    install_split_backward,
    split_backward_problems,
)
from trainer.pipeline.split_backward_te import RoutingWgradStore, te_problem


class _StandInTeStore:
    """TE's WeightGradStore as TE builds it (FIFO when deferring)."""

    def __init__(self, delay: bool = False) -> None:
        self.enabled, self.context = delay, queue.Queue() if delay else None

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, tensor_list, func) -> None:
        self.context.put([tensor_list, func])

    def pop(self):
        tensor_list, func = self.context.get_nowait()
        return func(*tensor_list), tensor_list


class _StandInGemm(torch.autograd.Function):
    """TE's linear autograd, reduced to the deferral contract (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, normalize, gathers):
        ctx.normalize, ctx.gathers = normalize, gathers
        total = torch.nn.functional.layer_norm(x, x.shape[-1:]) if normalize else x
        ctx.save_for_backward(x, total, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        out = total @ weight.t()
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, dy):
        x, total, weight = ctx.saved_tensors
        has_bias = ctx.has_bias

        def gemm(inp, grad):
            dw = grad.reshape(-1, grad.shape[-1]).t() @ inp.reshape(-1, inp.shape[-1])
            return dw, grad.reshape(-1, grad.shape[-1]).sum(0) if has_bias else None

        if ctx.gathers:  # TE's column-parallel linear under SP: the GEMM's input is gathered in the backward
            total = total.clone()
        if ctx.store is not None and ctx.store.delay_wgrad_compute():
            ctx.store.put([total, dy], gemm)
            dw = db = None
        else:
            dw, db = gemm(total, dy)
        dx = dy @ weight
        if ctx.normalize:
            with torch.enable_grad():
                xr = x.detach().requires_grad_(True)
                (dx,) = torch.autograd.grad(torch.nn.functional.layer_norm(xr, xr.shape[-1:]), xr, dx)
        return dx, dw, db, None, None, None


class _StandInTeModule(torch.nn.Module):
    normalize = False
    gathers = False

    def __init__(self, n_in: int, n_out: int, bias: bool = True, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(n_out, generator=g)) if bias else None
        self.weight_names, self.bias_names = ["weight"], (["bias"] if bias else [])
        self.fuse_wgrad_accumulation = False
        self.wgrad_store = _StandInTeStore()

    def _store_for_forward(self):
        raise NotImplementedError

    def forward(self, x):
        return _StandInGemm.apply(x, self.weight, self.bias, self._store_for_forward(), self.normalize, self.gathers)


Linear = type("Linear", (_StandInTeModule,), {
    "__module__": "transformer_engine.pytorch.module.linear",
    # TE 2.18's te.Linear binds the store at the forward only while it defers
    "_store_for_forward": lambda self: self.wgrad_store if self.wgrad_store.delay_wgrad_compute() else None})
LayerNormLinear = type("LayerNormLinear", (_StandInTeModule,), {
    "__module__": "transformer_engine.pytorch.module.layernorm_linear", "normalize": True,
    "_store_for_forward": lambda self: self.wgrad_store})  # bound always; asked at the backward
TELayerNormColumnParallelLinear = type("TELayerNormColumnParallelLinear", (LayerNormLinear,),
                                       {"__module__": "megatron.core.extensions.transformer_engine"})
LayerNormMLP = type("LayerNormMLP", (_StandInTeModule,), {"__module__": "transformer_engine.pytorch.module.layernorm_mlp"})
GroupedLinear = type("GroupedLinear", (_StandInTeModule,), {"__module__": "transformer_engine.pytorch.module.grouped_linear"})
TEFusedMLP = type("TEFusedMLP", (torch.nn.Module,), {"__module__": "megatron.core.extensions.transformer_engine"})


def _block(seed: int = 0) -> torch.nn.Sequential:
    """megatron-core's TE spec in miniature: a norm-fused column linear (8 -> 6) then a linear (6 -> 4)."""
    return torch.nn.Sequential(TELayerNormColumnParallelLinear(8, 6, seed=seed), Linear(6, 4, seed=seed + 1))


def _reference_grads(model: torch.nn.Sequential, xs: list[torch.Tensor], dys: list[torch.Tensor]):
    """Plain autograd through a copy (TE's store left as TE builds it: no deferral)."""
    ref = _block()
    ref.load_state_dict(model.state_dict())
    per_microbatch, input_grads = [], []
    for x, dy in zip(xs, dys, strict=True):
        ref.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        ref(x).backward(dy)
        per_microbatch.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        input_grads.append(x.grad)
    return per_microbatch, input_grads


def _inputs(count: int):
    g = torch.Generator().manual_seed(7)
    return ([torch.randn(5, 2, 8, generator=g) for _ in range(count)],
            [torch.randn(5, 2, 4, generator=g) for _ in range(count)])


def test_each_w_runs_its_own_i_in_any_order() -> None:
    """Three I steps, then W youngest first: after each W the weights (and GEMM-fused biases) hold exactly
    the microbatches whose W ran -- TE's per-module FIFO would have run microbatch 0's GEMMs first."""
    model = _block()
    split = install_split_backward([model])
    assert (split.te_linears, split.megatron_linears) == (2, 0)
    assert all(isinstance(m.wgrad_store, RoutingWgradStore) for m in model)
    xs, dys = _inputs(3)
    want, want_dx = _reference_grads(model, xs, dys)
    for m, (x, dy) in enumerate(zip(xs, dys, strict=True)):
        x = x.clone().requires_grad_(True)
        with split.capture((m, 0)) as store:
            model(x).backward(dy)
        torch.testing.assert_close(x.grad, want_dx[m])  # I gives the input gradient ...
        assert len(store) == 2  # ... and defers both GEMMs, fc2's first (backward order)
        assert all(p.grad is None for p in model.parameters()), "a weight or bias gradient came out of I"
    done = []
    for m in (2, 0, 1):
        assert split.replay((m, 0)) == 2
        done.append(m)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, sum(want[k][name] for k in done), msg=f"{name} after W of {done}")
    assert split.pending() == [] and (split.te_deferred, split.te_at_once) == (6, 0)


def test_w_adds_into_main_grad_where_megatron_ddp_keeps_it() -> None:
    model = _block()
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)
    split = install_split_backward([model])
    xs, dys = _inputs(2)
    want, _ = _reference_grads(model, xs, dys)
    for m in range(2):
        with split.capture(m):
            model(xs[m].requires_grad_(True)).backward(dys[m])
    split.replay(1)
    split.replay(0)
    for name, p in model.named_parameters():
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, want[0][name] + want[1][name], msg=name)


def test_a_backward_with_no_i_open_gets_its_gradients_at_once() -> None:
    """Outside the runtime's I steps (a CUDA graph warm-up, say) nothing waits for a W that never comes."""
    model = _block()
    split = install_split_backward([model])
    xs, dys = _inputs(1)
    want, _ = _reference_grads(model, xs, dys)
    model(xs[0].requires_grad_(True)).backward(dys[0])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[0][name], msg=name)
    assert (split.te_deferred, split.te_at_once) == (0, 2)


def test_te_and_megatron_linears_defer_into_the_same_store() -> None:
    """A TE block followed by megatron-core's local output layer (the last stage with TE's spec): one I,
    one store holding both kinds in backward order, one W."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            head = ColumnParallelLinear(4, 3, config=ModelParallelConfig(use_cpu_initialization=True),
                                        init_method=torch.nn.init.normal_, bias=False, tp_group=dist.group.WORLD)
        block = _block()
        split = install_split_backward([torch.nn.ModuleList([block, head])])
        assert (split.megatron_linears, split.te_linears) == (1, 2)
        x, dy = torch.randn(5, 2, 8), torch.randn(5, 2, 3)
        with split.capture(0) as store:
            head(block(x.requires_grad_(True)))[0].backward(dy)
        assert [type(e).__name__ for e in store.entries] == ["_Deferred", "TeDeferred", "TeDeferred"]
        assert head.weight.grad is None and block[0].weight.grad is None
        split.replay(0)
        assert head.weight.grad is not None and all(p.grad is not None for p in block.parameters())
    finally:
        if created:
            dist.destroy_process_group()


def test_what_the_w_step_covers_and_what_it_refuses_and_why() -> None:
    assert te_problem(Linear(2, 2)) is None
    assert te_problem(LayerNormLinear(2, 2)) is None
    assert te_problem(TELayerNormColumnParallelLinear(2, 2)) is None  # megatron-core's subclass
    assert "puts two GEMMs per backward" in te_problem(LayerNormMLP(2, 2))
    assert "grouped GEMM of MoE experts" in te_problem(GroupedLinear(2, 2))
    fused = TEFusedMLP()
    fused.weight = torch.nn.Parameter(torch.zeros(2, 2))
    assert te_problem(fused).startswith("TEFusedMLP: no deferred weight-gradient path is wired for it here")

    def with_attrs(**attrs):
        module = Linear(2, 2)
        for k, v in attrs.items():
            setattr(module, k, v)
        return te_problem(module)

    assert "TE >= 2.3" in with_attrs(wgrad_store=None)
    assert "built with delay_wgrad_compute=True" in with_attrs(wgrad_store=_StandInTeStore(delay=True))
    assert "fuse_wgrad_accumulation=True" in with_attrs(fuse_wgrad_accumulation=True)
    assert "Userbuffers" in with_attrs(ub_bulk_wgrad=True)
    assert "parameters_split" in with_attrs(weight_names=["query", "key"])
    assert with_attrs(sequence_parallel=True) is None
    sp = Linear(2, 2)
    sp.sequence_parallel = True
    assert "--dpp-sp-wgrad-input=regather" in te_problem(sp, "regather")


def test_refusals_come_before_anything_is_installed() -> None:
    good, bad = Linear(2, 2), LayerNormMLP(2, 2)
    chunk = torch.nn.Sequential(good, bad)
    problems = split_backward_problems([chunk])
    assert problems == [f"Transformer Engine layer {te_problem(bad)}"]
    with pytest.raises(ValueError, match="LayerNormMLP: te.LayerNormMLP puts two GEMMs"):
        install_split_backward([chunk])
    assert isinstance(good.wgrad_store, _StandInTeStore)  # nothing installed
    install_split_backward([torch.nn.Sequential(good)])
    with pytest.raises(ValueError, match="installed on it already"):
        install_split_backward([torch.nn.Sequential(good)])


def test_te_backward_dw_is_refused_by_name() -> None:
    model = _block()
    split = install_split_backward([model])
    with pytest.raises(RuntimeError, match=r"Linear.backward_dw\(\) called, but its deferred weight GEMMs belong"):
        model[1].wgrad_store.pop()
    x, dy = torch.randn(5, 2, 8), torch.randn(5, 2, 4)
    store = WeightGradStore()
    with split.capture_into(store):
        model(x.requires_grad_(True)).backward(dy)
    entries = list(store.entries)
    store.replay()
    assert all(e.tensors is None for e in entries)  # the operands are let go after W
    with pytest.raises(RuntimeError, match="deferred weight GEMM of Linear ran already"):
        entries[0].accumulate()


def _alive_before_backward(out: torch.Tensor, *held: torch.Tensor):
    """The storages alive when the backward starts: what the forward's nodes saved, and ``held``
    (on CUDA the caching allocator is asked instead: graph_operands.live_memory)."""
    seen, nodes, ptrs = set(), [out.grad_fn], {t.untyped_storage().data_ptr() for t in held}
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        ptrs |= {t.untyped_storage().data_ptr() for t in getattr(node, "saved_tensors", ()) if t is not None}
        nodes += [n for n, _ in node.next_functions]
    return lambda t: t.untyped_storage().data_ptr() in ptrs


def test_a_graph_slot_copies_what_tes_backward_allocated_and_reads_the_rest_in_place() -> None:
    """TE's deferred GEMMs under the slot graphs (trainer/pipeline/graph_operands.py): the warm-up's plan
    copies each operand the backward allocated -- the output gradients, and the input a column-parallel
    linear gathers in its backward under SP -- and leaves the forward's saved input and the incoming
    gradient where they are; W from the slot's copies gives autograd's gradients, also at a shorter length."""
    model = _block()
    model[0].gathers = True
    split = install_split_backward([model])
    xs, dys = _inputs(2)
    want, _ = _reference_grads(model, xs, dys)

    def i_step(store, x, dy):
        with split.capture_into(store):
            out = model(x.clone().requires_grad_(True))
            live = _alive_before_backward(out, dy)
            out.backward(dy, retain_graph=True)
        return live

    warm = WeightGradStore()
    live = i_step(warm, xs[0], dys[0])
    plan = plan_operands(warm.entries, live)
    warm.replay()
    # backward order: the linear (input saved, gradient incoming: kept), then the norm-fused one (both made by I)
    assert plan.copies == ((), (0, 1))
    assert [tuple(shape) for shape, _ in plan.buffers] == [(5, 2, 8), (5, 2, 6)]
    # TE's slots leave W's operands in the pool as megatron-core's do, unless asked to copy in I
    assert copies_wait(plan) and copies_wait(plan, "lazy")
    assert not copies_wait(plan, "in-i")
    model.zero_grad(set_to_none=True)
    buffers = [torch.full(shape, float("nan")) for shape, _ in plan.buffers]
    for m in (0, 1):
        store = StaticOperandStore(buffers, plan.copies)
        live = i_step(store, xs[m], dys[m])
        check_kept(store, live, 5)
        assert [t.data_ptr() for t in store.entries[1].tensors] == [b.data_ptr() for b in buffers]
        store.replay()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, sum(want[k][name] for k in range(m + 1)), msg=f"{name} after W {m}")
    # The lazy form (the default) computes the same from the pool and after an evacuation (copy_out_to).
    for evacuate in (False, True):
        model.zero_grad(set_to_none=True)
        store = StaticOperandStore([], plan.copies, deferred=True)
        check_kept(store, i_step(store, xs[0], dys[0]), 5)
        if evacuate:
            assert store.copy_out_to(buffers) == 2
            store = WeightGradStore(store.reading(buffers))
        store.replay()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[0][name], msg=f"{name}, lazy, evacuated: {evacuate}")
    model.zero_grad(set_to_none=True)
    short_want, _ = _reference_grads(model, [xs[0][:3]], [dys[0][:3]])
    store = StaticOperandStore(buffers, plan.copies)
    check_kept(store, i_step(store, xs[0][:3], dys[0][:3]), 3)
    store.replay()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, short_want[0][name], msg=f"{name} at length 3")


def test_a_plan_that_keeps_what_the_captured_backward_made_fails_the_capture() -> None:
    model = _block()
    split = install_split_backward([model])
    store = StaticOperandStore([torch.empty(5, 2, 6)], ((), (1,)))
    with split.capture_into(store):
        model(torch.randn(5, 2, 8).requires_grad_(True)).backward(torch.randn(5, 2, 4))
    with pytest.raises(RuntimeError, match=r"weight GEMM 1 \(Linear, Transformer Engine\)'s operand 2 "
                                           r"\(5, 2, 4\) was allocated by the captured backward"):
        check_kept(store, lambda t: t.shape[-1] != 4, 5)
    store.replay()
