"""Split backward (zero-bubble ``B = I + W``) for megatron-core's linear layers: its local spec's, here,
and Transformer Engine's through TE's own deferral (trainer/pipeline/split_backward_te.py).

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

Sequence parallelism: a column-parallel linear under ``--sequence-parallel`` multiplies the input
all-gathered over TP (its forward gathers it, its dgrad is reduce-scattered back to 1/TP of the
sequence, as megatron's). Its deferred weight GEMM needs that gathered input. Two ways
(``sequence_parallel_input``): ``"keep"`` (the default) keeps the gathered input from the forward
until W -- TP times the local input's memory per column-parallel linear, but W stays a pure local
GEMM (no collective to order across TP ranks, nothing to capture in a W graph); ``"regather"`` keeps
only the local 1/TP and all-gathers it again in W, as megatron's own backward does -- memory as
megatron, one TP all-gather per linear in every W (TP ranks run the same W in the same order: the
TP leader's decisions are replayed).

Transformer Engine's linears (``te.Linear``, ``te.LayerNormLinear``: every GEMM of megatron-core's
dense TE spec) defer into the same per-I stores: their backward hands TE's weight-GEMM closure to the
open store, and W runs it (trainer/pipeline/split_backward_te.py says how, and why TE's own per-module
queue is not used). Under CUDA graphs a slot's I copies what W needs out of the shared backward pool,
for both kinds alike (trainer/pipeline/graph_operands.py).

Refused (ValueError naming what was found): TE modules other than those (split_backward_te.te_problem
says why each), gradient-accumulation fusion, deferred embedding wgrad, GTP weight rematerialisation,
and DDP's ``overlap_grad_reduce`` when megatron's hooks start the reduction (they would count a bucket
ready during ``I``, before ``W`` has accumulated anything; trainer/model/ddp.py's wrapper leaves the
start to the runtime).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer.pipeline.split_backward_te import (
    accumulate_grad,
    install_te_split_backward,
    te_gemm_modules,
    te_split_backward_problems,
)
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
    gather_group: Any = None
    """``input`` is this rank's 1/TP of the sequence, to be all-gathered over this TP group before
    the GEMM (sequence parallelism, ``"regather"``); None: ``input`` is the whole GEMM operand."""

    def accumulate(self) -> None:
        accumulate_weight_grad(self)


@dataclass
class WeightGradStore:
    """The weight-gradient GEMMs that one I step left for its W step (holds input + grad_output):
    megatron linears' :class:`_Deferred` and Transformer Engine linears' ``TeDeferred``, in backward order."""

    entries: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: Any) -> None:
        self.entries.append(entry)

    def replay(self) -> None:
        """Compute and accumulate every deferred weight gradient, then drop the saved tensors."""
        entries, self.entries = self.entries, []  # release input/grad_output as we go
        while entries:
            entries.pop(0).accumulate()


def weight_grad(entry: _Deferred) -> torch.Tensor:
    """``grad_output^T @ input`` over all leading (token) dimensions, in megatron's dtype."""
    grad_output = entry.grad_output.contiguous()
    inputs = entry.input.contiguous()
    if entry.gather_group is not None:
        inputs = _all_gather_sequence(inputs, entry.gather_group)
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
    accumulate_grad(entry.weight, weight_grad(entry))


class SplitBackward:
    """Shared by the patched linears of one rank and its runtime: which store, if any, is open.

    A plain attribute, not thread-local state: on CUDA the autograd engine runs backward on its own
    device thread while the caller blocks, so the store must be visible across threads.
    """

    def __init__(self, sequence_parallel_input: str = "keep") -> None:
        if sequence_parallel_input not in SEQUENCE_PARALLEL_INPUTS:
            raise ValueError(f"sequence_parallel_input={sequence_parallel_input!r} must be one of "
                             f"{', '.join(SEQUENCE_PARALLEL_INPUTS)}")
        self.active: WeightGradStore | None = None
        self._stores: dict[Hashable, WeightGradStore] = {}
        self.regather = sequence_parallel_input == "regather"
        """Sequence parallelism: all-gather the input again in W instead of keeping it (module docstring)."""
        self.megatron_linears = 0
        """How many megatron-core local linears defer their weight GEMM (set by install_split_backward)."""
        self.te_linears = 0
        """How many Transformer Engine linears defer theirs (trainer/pipeline/split_backward_te.py)."""
        self.te_deferred = 0
        """TE weight GEMMs put into an open store (run by a W step) ..."""
        self.te_at_once = 0
        """... and run at once because no store was open (a backward outside the runtime's I steps)."""

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


SEQUENCE_PARALLEL_INPUTS = ("keep", "regather")
"""How a deferred weight GEMM under sequence parallelism gets its gathered input (module docstring)."""


def _all_gather_sequence(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The TP ranks' sequence shards, concatenated along the sequence (first) dimension, in a tensor
    of its own (megatron gathers into a global buffer that the next gather reuses: no good to keep)."""
    gathered = torch.empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]),
                           dtype=local.dtype, device=local.device)
    with torch.no_grad():  # W runs with grad mode on; gloo's gather writes into views of ``gathered``
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
    return gathered


class _DeferrableLinear(torch.autograd.Function):
    """``input @ weight.T (+ bias)`` whose weight GEMM can wait for the W step.

    ``sequence_parallel``: ``input`` is this rank's 1/TP of the sequence; the forward multiplies it
    gathered over TP and the input gradient is reduce-scattered back, as megatron's column-parallel
    linear does."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group, controller, sequence_parallel):  # noqa: A002
        total_input = _all_gather_sequence(input, tp_group) if sequence_parallel else input
        # What W multiplies: the gathered input, or (regather) the local shard it gathers again.
        kept = input if sequence_parallel and controller.regather else total_input
        ctx.save_for_backward(kept, weight)
        ctx.has_bias = bias is not None
        ctx.allreduce_dgrad, ctx.tp_group, ctx.controller = allreduce_dgrad, tp_group, controller
        ctx.sequence_parallel, ctx.local_rows = sequence_parallel, input.shape[0]
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        kept, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            # Megatron's column-parallel dgrad all-reduce; started before the wgrad work (if any).
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        elif ctx.sequence_parallel:
            # Megatron's sequence-parallel dgrad: reduce-scatter back to this rank's 1/TP of the sequence.
            reduced = torch.empty((ctx.local_rows, *grad_input.shape[1:]), dtype=grad_input.dtype,
                                  device=grad_input.device)
            handle = dist.reduce_scatter_tensor(reduced, grad_input.contiguous(), group=ctx.tp_group, async_op=True)
            grad_input = reduced
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.has_bias else None
        store = ctx.controller.active
        regathered = ctx.sequence_parallel and ctx.controller.regather
        entry = _Deferred(weight, kept, grad_output, _autocast_dtype(weight),
                          gather_group=ctx.tp_group if regathered else None)
        if store is not None:
            store.add(entry)
            grad_weight = None  # accumulated by W; DDP's hook sees grad None and adds nothing
        else:
            grad_weight = weight_grad(entry)
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


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
    if gradient_accumulation_fusion:
        problems.append("gradient_accumulation_fusion=True")
    if grad_output_buffer is not None:
        problems.append("grad_output_buffer (defer_embedding_wgrad_compute)")
    extra.pop("async_grad_allreduce", None)  # deprecated in megatron-core, ignored there too
    output_dtype = extra.pop("output_dtype", None)  # megatron-core main (> 0.19): a TE GEMM when it differs
    if output_dtype is not None and output_dtype != input.dtype:
        problems.append(f"output_dtype={output_dtype} (input is {input.dtype})")
    problems += [f"{k}={v!r}" for k, v in sorted(extra.items()) if not _is_inert(v)]
    if sequence_parallel and allreduce_dgrad:  # megatron asserts the same: SP reduce-scatters instead
        problems.append("sequence_parallel=True with allreduce_dgrad=True")
    raise_if_any(problems, f"split backward cannot run {type(module).__name__}")
    if (allreduce_dgrad or sequence_parallel) and tp_group is None:
        tp_group = module.tp_group
    return _DeferrableLinear.apply(input, weight, bias, bool(allreduce_dgrad), tp_group, controller,
                                   bool(sequence_parallel))


def _is_inert(value: Any) -> bool:
    return any(value is v or (type(value) is type(v) and value == v) for v in _INERT_VALUES)


def _is_megatron_linear(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, ColumnParallelLinear | RowParallelLinear)


def split_backward_problems(chunks: list[torch.nn.Module], sequence_parallel_input: str = "keep") -> list[str]:
    """Every reason the chunks cannot run a split backward (empty: they can)."""
    # Of Transformer Engine's modules only those holding a GEMM weight have a weight gradient to defer
    # (TE's norms -- megatron-core builds the block's final norm from TE wherever TE is installed, even
    # with the local layer spec -- and its attention have none).
    te = te_gemm_modules(chunks)
    problems = te_split_backward_problems(te, sequence_parallel_input)
    linears = [m for chunk in chunks for m in chunk.modules() if _is_megatron_linear(m)]
    if not linears and not te:
        problems.append("no ColumnParallelLinear/RowParallelLinear in the model: nothing to split")
    seen: set[str] = set()
    for m in linears:
        config = m.config
        checks = {
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
        if ddp_config is not None and getattr(ddp_config, "overlap_grad_reduce", False) \
                and not getattr(chunk, "reduction_launched_by_runtime", False):
            problems.append(f"chunk {i}: DDP overlap_grad_reduce=True with megatron's own DDP: its hooks would "
                            "count a bucket ready during I, before W has accumulated the weight gradients "
                            "(wrap the chunks with trainer.model.ddp.runtime_reduced_ddp)")
    return problems


def install_split_backward(chunks: list[torch.nn.Module], sequence_parallel_input: str = "keep") -> SplitBackward:
    """Patch every megatron linear of ``chunks`` (per instance), give every Transformer Engine linear a
    store that files into the runtime's I steps (trainer/pipeline/split_backward_te.py), and return
    their shared controller. ``sequence_parallel_input``: "keep" or "regather" (the module docstring
    says what each costs; megatron's linears only).

    Raises ValueError listing every unsupported feature found; nothing is patched then. Calling it
    twice on the same chunks is an error (the second patch would wrap the first).
    """
    problems = split_backward_problems(chunks, sequence_parallel_input)
    raise_if_any(problems, "split backward (--dpp-policy dpp-zb / zb-h1) is not possible here")
    controller = SplitBackward(sequence_parallel_input)
    for chunk in chunks:
        for module in chunk.modules():
            if not _is_megatron_linear(module):
                continue
            if "_forward_impl" in vars(module):
                raise ValueError(f"{type(module).__name__} already has a per-instance _forward_impl "
                                 "(split backward installed twice?)")
            original = module._forward_impl  # the class's bound method: megatron's own path
            module._forward_impl = functools.partial(_split_forward_impl, module, original, controller)
            controller.megatron_linears += 1
    controller.te_linears = install_te_split_backward(chunks, controller)
    return controller
