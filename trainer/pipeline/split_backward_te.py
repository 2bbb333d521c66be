"""Split backward (``B = I + W``) for Transformer Engine's linear layers, through TE's own deferral.

What TE offers (>= 2.3; docs/transformer_engine.md, "Split backward with Transformer Engine"): every
TE module with a GEMM weight holds a ``wgrad_store`` (``transformer_engine/pytorch/module/_common.py``,
``WeightGradStore``). Built with ``delay_wgrad_compute=True``, its backward computes the input
gradient, then ``put``s ``([input, grad_output], gemm)`` into that store instead of running the weight
GEMM, and returns no weight gradient; the module's ``backward_dw()`` later ``pop``s the *oldest* entry,
runs ``gemm`` (the weight gradient, with the bias gradient when the bias is fused into it) and sets
``weight.grad``. The store is one FIFO queue per module.

Why the queue is not used: ``backward_dw`` can only honour W steps in the order of their I steps, per
module. The runtime's W order is not that: dpp-zb picks the *youngest* deferred W at one chunk per
stage (``DynamicOptions.weight_order``) and may order microbatches by cost (trainer/schedule/dynamic.py).
So :func:`install_te_split_backward` gives every covered TE linear a :class:`RoutingWgradStore` of its
own. It keeps TE's side of the contract (``delay_wgrad_compute()`` is true, so the forward binds it and
the backward ``put``s into it) and files each ``put`` under the (microbatch, chunk) whose I is running:
the same per-I store that megatron-core's local linears defer into (trainer/pipeline/split_backward.py).
A W then runs exactly its own I's GEMMs, in any order.

W (:meth:`TeDeferred.accumulate`) calls TE's own GEMM closure -- cuBLASLt, the output dtype and the
bias fusion TE chose during I -- and adds the result where TE's non-deferred backward ends up:
autograd would put it in ``weight.grad`` (in the weight's dtype) and megatron DDP's hook would add that
into ``weight.main_grad``. The bias likewise when the GEMM computed its gradient.

Covered: ``te.Linear`` and ``te.LayerNormLinear`` and their subclasses -- megatron-core's
``TELinear``/``TERowParallelLinear``/``TEColumnParallelLinear`` and ``TELayerNormColumnParallelLinear``,
all the GEMMs of its dense TE layer spec. :func:`te_problem` names why anything else is refused.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

COVERED = {
    ("transformer_engine.pytorch.module.linear", "Linear"): "te.Linear",
    ("transformer_engine.pytorch.module.layernorm_linear", "LayerNormLinear"): "te.LayerNormLinear",
}
"""TE classes (module, name) whose backward puts exactly one ``([input, grad_output], gemm)`` per call,
``gemm`` returning ``(weight_grad, bias_grad_or_None, ...)`` (TE 2.3: a 4-tuple; 2.8 .. 2.18: a pair)."""

REFUSED = {
    "LayerNormMLP": "te.LayerNormMLP puts two GEMMs per backward (fc2's, then fc1's) whose backward_dw pops "
                    "them as a pair with its own bias handling; megatron-core's layer specs build their MLP "
                    "from te.LayerNormLinear and te.Linear, which are covered",
    "GroupedLinear": "te.GroupedLinear is the grouped GEMM of MoE experts, whose deferred entry holds "
                     "per-expert gradient lists (no --num-experts here)",
}
"""Why TE modules with a GEMM weight other than :data:`COVERED` are refused, by TE class name."""

_USERBUFFERS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_ag_fprop", "ub_overlap_rs_fprop",
                "ub_overlap_ag_dgrad", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")


def is_transformer_engine(module: torch.nn.Module) -> bool:
    """Whether ``module`` is (or wraps, as megatron-core's ``TE*`` classes do) a Transformer Engine module."""
    return any("transformer_engine" in cls.__module__ or cls.__name__.startswith("TE")
               for cls in type(module).__mro__[:-1])


def _covered(module: torch.nn.Module) -> bool:
    return any((cls.__module__, cls.__name__) in COVERED for cls in type(module).__mro__)


def _refused_why(module: torch.nn.Module) -> str:
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformer_engine.") and cls.__name__ in REFUSED:
            return REFUSED[cls.__name__]
    return "no deferred weight-gradient path is wired for it here"


def te_problem(module: torch.nn.Module, sequence_parallel_input: str = "keep") -> str | None:
    """Why the runtime's W cannot take over ``module``'s weight GEMM (a TE module holding a GEMM
    weight), or None when it can. Reads only attributes, so stand-ins test it without TE."""
    name = type(module).__name__
    if not _covered(module):
        return f"{name}: {_refused_why(module)} (covered: {', '.join(COVERED.values())})"
    store = getattr(module, "wgrad_store", None)
    if isinstance(store, RoutingWgradStore):
        return f"{name}: split backward is installed on it already (installed twice?)"
    if store is None or not callable(getattr(store, "put", None)) \
            or not callable(getattr(store, "delay_wgrad_compute", None)):
        return (f"{name}: this Transformer Engine has no deferred weight-gradient store (wgrad_store: TE >= 2.3; "
                "this project builds 2.18 with scripts/te/build.sh)")
    if store.delay_wgrad_compute():
        return (f"{name}: built with delay_wgrad_compute=True (megatron-core's delay_wgrad_compute, whose own "
                "backward_dw calls and DDP hooks the runtime's W would bypass)")
    if getattr(module, "fuse_wgrad_accumulation", False):
        return (f"{name}: fuse_wgrad_accumulation=True (--gradient-accumulation-fusion): TE's GEMM would write "
                "main_grad itself, overwriting it for the first microbatch of the forward (is_first_microbatch) -- "
                "right only if that microbatch's W came first")
    ub = [a for a in _USERBUFFERS if getattr(module, a, False)]
    if ub:
        return (f"{name}: Userbuffers tensor-parallel overlap ({', '.join(ub)}; --tp-comm-overlap): TE refuses "
                "a deferred weight GEMM with it")
    weights, biases = list(getattr(module, "weight_names", ["weight"])), list(getattr(module, "bias_names", []))
    if len(weights) != 1 or len(biases) > 1:
        return (f"{name}: weight split into parameters {weights + biases} (parameters_split): W adds one "
                "weight's (and one bias's) gradient")
    if sequence_parallel_input != "keep" and getattr(module, "sequence_parallel", False):
        return (f"{name}: --dpp-sp-wgrad-input={sequence_parallel_input} re-gathers the inputs of megatron-core's "
                "local linears; TE's deferred GEMM holds the operands its backward gathered (keep)")
    return None


def accumulate_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` where a returned gradient ends up: autograd casts it to the parameter's dtype into
    ``param.grad``, then megatron DDP's hook adds that into ``param.main_grad`` and clears it. The
    backward returned None for this parameter, so that hook saw nothing; its addition is done here."""
    grad = grad.to(param.dtype)
    main_grad = getattr(param, "main_grad", None)
    with torch.no_grad():
        if main_grad is not None:
            main_grad.add_(grad)
        elif param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


@dataclass
class TeDeferred:
    """One weight GEMM a TE linear put aside: TE's closure and the operands it holds until W
    (the layer's input -- gathered over TP where its backward gathered it -- and its output gradient)."""

    module_name: str
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    tensors: list[Any] | None
    gemm: Any

    def accumulate(self) -> None:
        """Run the GEMM, add its weight (and bias) gradient, and drop the operands."""
        if self.tensors is None:
            raise RuntimeError(f"split backward: the deferred weight GEMM of {self.module_name} ran already")
        tensors, gemm, self.tensors, self.gemm = self.tensors, self.gemm, None, None
        result = gemm(*tensors)
        del tensors
        weight_grad, bias_grad = result[0], result[1]
        accumulate_grad(self.weight, weight_grad)
        if bias_grad is not None:
            if self.bias is None:
                raise RuntimeError(f"split backward: {self.module_name}'s deferred GEMM returned a bias gradient "
                                   "but the module has no bias parameter")
            accumulate_grad(self.bias, bias_grad)


class RoutingWgradStore:
    """Stands in for a TE module's ``wgrad_store`` (module docstring): always deferring, and each
    ``put`` goes into the store the runtime opened for the running I (``controller.active``).

    With no store open -- a backward outside the runtime's I steps -- the GEMM runs at once and its
    gradient is added as W would, so such a backward still yields every gradient."""

    enabled = True
    context = None  # TE's FIFO queue: not used (GroupedLinear's backward_dw reads it; it is refused)

    def __init__(self, module: torch.nn.Module, controller: Any) -> None:
        self.module_name = type(module).__name__
        self.controller = controller
        self._module = weakref.ref(module)  # the module holds this store: no cycle through it
        self._weight_name = list(getattr(module, "weight_names", ["weight"]))[0]
        self._bias_name = next(iter(getattr(module, "bias_names", [])), None)

    def delay_wgrad_compute(self) -> bool:
        return True

    def enable_delay_wgrad_compute(self) -> None:
        pass

    def disable_delay_wgrad_compute(self) -> None:
        raise RuntimeError(f"split backward: {self.module_name}'s weight GEMMs are deferred by the DPP runtime's "
                           "W steps (trainer/pipeline/split_backward_te.py); they cannot be switched back on")

    def put(self, tensor_list: list[Any], func: Any) -> None:
        module = self._module()
        if module is None:
            raise RuntimeError(f"split backward: {self.module_name} was freed while its backward ran")
        if getattr(module, "fp8", False):
            # TE reduces the backward's FP8 scaling factors at the end of I, before this GEMM would run.
            raise RuntimeError(f"split backward: {self.module_name} ran in FP8; a deferred TE weight GEMM is "
                               "wired for bf16/fp16/fp32 only")
        # The parameters as they are now (read at each put, not kept from the install).
        bias = getattr(module, self._bias_name, None) if self._bias_name else None
        entry = TeDeferred(self.module_name, getattr(module, self._weight_name), bias, list(tensor_list), func)
        store = self.controller.active
        if store is None:
            self.controller.te_at_once += 1
            entry.accumulate()
        else:
            self.controller.te_deferred += 1
            store.add(entry)

    def pop(self):
        raise RuntimeError(f"split backward: {self.module_name}.backward_dw() called, but its deferred weight GEMMs "
                           "belong to the DPP runtime's W steps (trainer/pipeline/split_backward_te.py)")

    def assert_empty(self) -> None:
        """Nothing is ever queued here (the runtime checks its own stores at the end of a step)."""


def te_gemm_modules(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every Transformer Engine module of ``chunks`` that itself holds a matrix parameter (a GEMM's
    weight; TE's norms hold vectors and its attention none)."""
    return [m for chunk in chunks for m in chunk.modules()
            if is_transformer_engine(m) and any(p.dim() >= 2 for p in m.parameters(recurse=False))]


def te_split_backward_problems(modules: list[torch.nn.Module], sequence_parallel_input: str = "keep") -> list[str]:
    """Why these TE modules (:func:`te_gemm_modules` of the chunks) cannot run a split backward, one line
    per kind (empty: they can)."""
    found: dict[str, None] = {}
    for module in modules:
        problem = te_problem(module, sequence_parallel_input)
        if problem is not None:
            found.setdefault(f"Transformer Engine layer {problem}")
    return list(found)


def install_te_split_backward(chunks: list[torch.nn.Module], controller: Any) -> int:
    """Give every TE linear of ``chunks`` a :class:`RoutingWgradStore` filing into ``controller``'s
    open store; returns how many. Call after :func:`te_split_backward_problems` found nothing."""
    modules = te_gemm_modules(chunks)
    for module in modules:
        module.wgrad_store = RoutingWgradStore(module, controller)
    return len(modules)
