"""Split backward (zero-bubble ``B = I + W``) for megatron-core's local-spec linear layers.

A zero-bubble schedule runs a microbatch's backward in two steps: ``I`` computes the input gradient
(what the upstream stage waits for) and ``W`` the weight gradients, later, in what would otherwise be
idle time. Almost all of a transformer's weight-gradient work is the ``grad_output^T @ input`` GEMM
of its linear layers, so only that GEMM is deferred; everything else (norms, embeddings, biases,
BERT's plain ``torch.nn.Linear`` heads) still gets its gradient during ``I``.

How: :func:`install_split_backward` replaces ``_forward_impl`` on every ``ColumnParallelLinear`` /
``RowParallelLinear`` *instance* of the given chunks (megatron's forward calls it with keywords) by
:class:`_DeferrableLinear`. Its forward is megatron's (``input @ weight.T (+ bias)``); its backward
computes ``grad_input`` (all-reduced over TP when megatron would) and then, if the runtime opened a
:class:`WeightGradStore` with :meth:`SplitBackward.capture`, records ``(weight, input, grad_output)``
there instead of computing ``grad_weight``. :meth:`SplitBackward.replay` (the ``W`` step) computes
the GEMMs and accumulates them where megatron's path would end up: ``weight.main_grad`` under
megatron DDP, else ``weight.grad``. Without an open store the weight gradient is computed at once,
so evaluation and non-split schedules behave as before.

Refused (ValueError naming what was found): Transformer Engine layers, sequence parallelism,
gradient-accumulation fusion, deferred embedding wgrad, GTP weight rematerialisation, and DDP's
``overlap_grad_reduce`` (its bucket readiness is signalled by the parameter hooks that fire during
``I``, before ``W`` has accumulated anything).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer.problems import raise_if_any

# megatron-core's own decorators for its linear Function: re-enter the forward's CUDA autocast
# state in backward, so I computes grad_input in the same dtype as megatron's backward would.
_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="cuda")
_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")

_MEGATRON_LINEARS = ("ColumnParallelLinear", "RowParallelLinear")
# Keywords megatron-core (0.16 .. 0.19) passes to _forward_impl that mean "feature off" at these
# values; anything else unknown to us is refused rather than silently dropped.
_INERT_VALUES: tuple[Any, ...] = (None, False, 0, 1)


@dataclass
class _Deferred:
    """One postponed weight-gradient GEMM: ``grad_weight = grad_output^T @ input``."""

    weight: torch.nn.Parameter
    input: torch.Tensor
    grad_output: torch.Tensor
    autocast_dtype: torch.dtype | None
    """CUDA autocast dtype active when megatron's backward would have run the GEMM (None: off)."""


@dataclass
class WeightGradStore:
    """The weight-gradient GEMMs that one I step left for its W step (holds input + grad_output)."""

    entries: list[_Deferred] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: _Deferred) -> None:
        self.entries.append(entry)

    def replay(self) -> None:
        """Compute and accumulate every deferred weight gradient, then drop the saved tensors."""
        entries, self.entries = self.entries, []  # release input/grad_output as we go
        while entries:
            accumulate_weight_grad(entries.pop(0))


class StaticOperandStore(WeightGradStore):
    """The store a CUDA graph slot's I graph is captured with (trainer/pipeline/cuda_graphs.py).

    Why: a slot's backward graphs share one memory pool with every other backward of the stage, so a
    ``grad_output`` the I graph allocates is overwritten by the next backward replay -- before this
    slot's W graph reads it. Each deferred ``grad_output`` is therefore copied, inside the captured I,
    into a buffer the slot owns (``buffers``, sized by the warm-up for the longest
    length; a shorter length uses the leading rows), and the entry keeps that buffer. The linears'
    inputs need no copy: they are forward activations, in the slot's own forward pool, untouched
    until the slot's next forward -- which comes after its W. One copy of each output gradient per
    I (on the issue-12 model ~75 MB per layer: tens of microseconds against a layer's backward)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.buffers = buffers

    def add(self, entry: _Deferred) -> None:
        i, grad = len(self.entries), entry.grad_output
        if i >= len(self.buffers):
            raise RuntimeError(f"split backward with CUDA graphs: weight GEMM {i + 1} deferred, but the slot "
                               f"has buffers for {len(self.buffers)} (the backward defers more GEMMs than it did "
                               "when the buffers were sized)")
        view = self.buffers[i][:grad.shape[0]] if grad.dim() else self.buffers[i]
        if view.shape != grad.shape or view.dtype != grad.dtype:
            raise RuntimeError(f"split backward with CUDA graphs: weight GEMM {i + 1}'s output gradient is "
                               f"{tuple(grad.shape)} {grad.dtype}, its buffer {tuple(view.shape)} {view.dtype} "
                               "(only the leading, sequence dimension may be shorter than the longest length's)")
        view.copy_(grad)
        super().add(dataclasses.replace(entry, grad_output=view))


def weight_grad(entry: _Deferred) -> torch.Tensor:
    """``grad_output^T @ input`` over all leading (token) dimensions, in megatron's dtype."""
    grad_output = entry.grad_output.contiguous()
    inputs = entry.input.contiguous()
    grad_output = grad_output.view(-1, grad_output.shape[-1])
    inputs = inputs.view(-1, inputs.shape[-1])
    if entry.autocast_dtype is None:
        return grad_output.t().matmul(inputs)
    with torch.autocast("cuda", dtype=entry.autocast_dtype):
        return grad_output.t().matmul(inputs)


def accumulate_weight_grad(entry: _Deferred) -> None:
    """Add ``entry``'s gradient where megatron's non-fused path ends up.

    Megatron returns grad_weight to autograd (cast to the parameter's dtype), then megatron DDP's
    hook adds ``param.grad`` into ``param.main_grad`` and clears it. The Function returned None for
    the weight during I, so that hook saw nothing; we do its addition here.
    """
    weight = entry.weight
    grad = weight_grad(entry).to(weight.dtype)
    main_grad = getattr(weight, "main_grad", None)
    with torch.no_grad():
        if main_grad is not None:
            main_grad.add_(grad)
        elif weight.grad is None:
            weight.grad = grad
        else:
            weight.grad.add_(grad)


class SplitBackward:
    """Shared by the patched linears of one rank and its runtime: which store, if any, is open.

    A plain attribute, not thread-local state: on CUDA the autograd engine runs backward on its own
    device thread while the caller blocks, so the store must be visible across threads.
    """

    def __init__(self) -> None:
        self.active: WeightGradStore | None = None
        self._stores: dict[Hashable, WeightGradStore] = {}

    @contextlib.contextmanager
    def capture(self, key: Hashable) -> Iterator[WeightGradStore]:
        """Backwards run inside defer their weight GEMMs into the store of ``key`` (an I step)."""
        with self.capture_into(self._stores.setdefault(key, WeightGradStore()), key) as store:
            yield store

    @contextlib.contextmanager
    def capture_into(self, store: WeightGradStore, what: Hashable = "a store") -> Iterator[WeightGradStore]:
        """Backwards run inside defer their weight GEMMs into ``store``, which the caller keeps (no
        W step of the runtime will replay it): how a CUDA graph slot captures its I and W graphs."""
        if self.active is not None:
            raise RuntimeError(f"split backward: a capture is already open while opening {what!r}")
        self.active = store
        try:
            yield store
        finally:
            self.active = None

    def replay(self, key: Hashable) -> int:
        """Run the W step of ``key``; returns how many GEMMs it ran. The store is dropped after."""
        store = self._stores.pop(key, None)
        if store is None:
            raise RuntimeError(f"split backward: W of {key!r} has no store (its I did not run)")
        count = len(store)
        store.replay()
        return count

    def pending(self) -> list[Hashable]:
        """Keys whose W has not run yet (a finished step leaves none)."""
        return list(self._stores)


class _DeferrableLinear(torch.autograd.Function):
    """``input @ weight.T (+ bias)`` whose weight GEMM can wait for the W step."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group, controller):  # noqa: A002
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        ctx.allreduce_dgrad, ctx.tp_group, ctx.controller = allreduce_dgrad, tp_group, controller
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors  # noqa: A001
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            # Megatron's column-parallel dgrad all-reduce; started before the wgrad work (if any).
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.has_bias else None
        store = ctx.controller.active
        entry = _Deferred(weight, input, grad_output, _autocast_dtype(weight))
        if store is not None:
            store.add(entry)
            grad_weight = None  # accumulated by W; DDP's hook sees grad None and adds nothing
        else:
            grad_weight = weight_grad(entry)
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def _autocast_dtype(weight: torch.Tensor) -> torch.dtype | None:
    if weight.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _split_forward_impl(module: torch.nn.Module, original, controller: SplitBackward, input,  # noqa: A002
                        weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                        sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None,
                        tp_group=None, **extra):
    """Replacement for megatron's ``_forward_impl`` (same keywords, 0.16 and 0.19)."""
    if not weight.requires_grad:  # frozen weight: megatron's own path computes no wgrad anyway
        return original(input=input, weight=weight, bias=bias,
                        gradient_accumulation_fusion=gradient_accumulation_fusion,
                        allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                        grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                        tp_group=tp_group, **extra)
    problems = []
    if sequence_parallel:
        problems.append("sequence_parallel=True")
    if gradient_accumulation_fusion:
        problems.append("gradient_accumulation_fusion=True")
    if grad_output_buffer is not None:
        problems.append("grad_output_buffer (defer_embedding_wgrad_compute)")
    extra.pop("async_grad_allreduce", None)  # deprecated in megatron-core, ignored there too
    output_dtype = extra.pop("output_dtype", None)  # megatron-core main (> 0.19): a TE GEMM when it differs
    if output_dtype is not None and output_dtype != input.dtype:
        problems.append(f"output_dtype={output_dtype} (input is {input.dtype})")
    problems += [f"{k}={v!r}" for k, v in sorted(extra.items()) if not _is_inert(v)]
    raise_if_any(problems, f"split backward cannot run {type(module).__name__}")
    if allreduce_dgrad and tp_group is None:
        tp_group = module.tp_group
    return _DeferrableLinear.apply(input, weight, bias, bool(allreduce_dgrad), tp_group, controller)


def _is_inert(value: Any) -> bool:
    return any(value is v or (type(value) is type(v) and value == v) for v in _INERT_VALUES)


def _is_megatron_linear(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, ColumnParallelLinear | RowParallelLinear)


def _is_transformer_engine(module: torch.nn.Module) -> bool:
    cls = type(module)
    return "transformer_engine" in cls.__module__ or cls.__name__.startswith("TE")


def split_backward_problems(chunks: list[torch.nn.Module]) -> list[str]:
    """Every reason the chunks cannot run a split backward (empty: they can)."""
    problems: list[str] = []
    te = sorted({type(m).__name__ for chunk in chunks for m in chunk.modules() if _is_transformer_engine(m)})
    if te:
        problems.append(f"Transformer Engine layers ({', '.join(te)}): only megatron-core's local spec "
                        "is supported (--transformer-impl local)")
    linears = [m for chunk in chunks for m in chunk.modules() if _is_megatron_linear(m)]
    if not linears and not te:
        problems.append("no ColumnParallelLinear/RowParallelLinear in the model: nothing to split")
    seen: set[str] = set()
    for m in linears:
        config = m.config
        checks = {
            "sequence_parallel": getattr(m, "sequence_parallel", False),
            "gradient_accumulation_fusion": getattr(m, "gradient_accumulation_fusion", False),
            "defer_embedding_wgrad_compute": getattr(config, "defer_embedding_wgrad_compute", False),
            "GTP weight rematerialisation (gtp_remat_size > 1)": getattr(m, "gtp_remat_size", 1) > 1,
        }
        for name, on in checks.items():
            if on and name not in seen:
                seen.add(name)
                problems.append(f"{name} is on: not supported with a split backward")
    for i, chunk in enumerate(chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and getattr(ddp_config, "overlap_grad_reduce", False):
            problems.append(f"chunk {i}: DDP overlap_grad_reduce=True: its bucket readiness hooks fire "
                            "during I, before W has accumulated the weight gradients")
    return problems


def install_split_backward(chunks: list[torch.nn.Module]) -> SplitBackward:
    """Patch every megatron linear of ``chunks`` (per instance) and return their shared controller.

    Raises ValueError listing every unsupported feature found; nothing is patched then. Calling it
    twice on the same chunks is an error (the second patch would wrap the first).
    """
    problems = split_backward_problems(chunks)
    raise_if_any(problems, "split backward (--dpp-policy dpp-zb / zb-h1) is not possible here")
    controller = SplitBackward()
    for chunk in chunks:
        for module in chunk.modules():
            if not _is_megatron_linear(module):
                continue
            if "_forward_impl" in vars(module):
                raise ValueError(f"{type(module).__name__} already has a per-instance _forward_impl "
                                 "(split backward installed twice?)")
            original = module._forward_impl  # the class's bound method: megatron's own path
            module._forward_impl = functools.partial(_split_forward_impl, module, original, controller)
    return controller
