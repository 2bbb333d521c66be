"""Run megatron-core on CPU/gloo (tests, CI) without editing the installed package.

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths. On a
process without CUDA, :func:`apply_cpu_shims` patches them *at run time, in this process only*:

1. ``GlobalMemoryBuffer.get_tensor`` allocates with ``device=torch.cuda.current_device()``; the shim
   allocates on the CPU (the buffer is used by TP's all-gather paths).
2. The CUDA RNG tracker (``CudaRNGStatesTracker.fork`` / ``.add`` and
   ``model_parallel_cuda_manual_seed``) saves and restores *CUDA* generator state around dropout; the
   shim makes them no-ops, so dropout on CPU draws from the default CPU generator (seeded by us).
3. Hard-coded CUDA allocations elsewhere (``torch.tensor(..., device='cuda')`` in the optimizer and
   grad clipping, ``torch.cuda.current_device()`` in the DDP grad buffers, ``tensor.cuda()``): a
   :class:`torch.overrides.TorchFunctionMode` rewrites a CUDA ``device=`` argument to ``cpu`` and makes
   ``Tensor.cuda()`` the identity; ``torch.cuda.current_device`` returns 0 (which the mode maps to CPU).
4. ``clip_grads`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``: the mode reports CPU tensors'
   ``Tensor.type()`` (no arguments) with the ``torch.cuda.`` prefix so these CUDA-only asserts pass.
5. Activation recompute (``tensor_parallel.checkpoint``'s ``CheckpointFunction``, used by
   ``--recompute-granularity``) saves the CPU generator *and* the CUDA generator before the forward and
   restores both before recomputing it; the private ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
   it calls are replaced by ones that keep no CUDA state (there is none). The CPU generator, the one
   dropout draws from here, is still saved and restored, so recomputed dropout masks are the same.
6. Inside ``torch.autograd.backward`` / ``Tensor.backward`` the mode of item 3 is off (torch disables a
   mode while its own handler runs, and the backward runs in it), so ``torch.cuda.current_device()``
   answers "cpu" for the duration: the buffers megatron allocates in backward (``--sequence-parallel``'s
   reduce-scatter / all-gather outputs) stay on the CPU.
7. Distributed checkpointing (``megatron.core.dist_checkpointing``'s torch_dist writer) calls
   ``torch.cuda.synchronize()`` after staging tensors for the write, to wait for device-to-host copies;
   a CPU-only build raises there, and with no device there is nothing to wait for: a no-op.

Outside the CPU shims, :func:`torch_adam_distributed_optimizer_load` works around two faults of megatron-core's distributed
optimizer when it loads into torch's own Adam (no Apex/TE, so every CPU run), and
:func:`fully_reshardable_bucket_offsets` around one of its save in the fully reshardable form (every device).

Everything is reversible (:class:`CpuShims.remove`) and refused when CUDA is available: a GPU run must
never silently compute on the CPU. Public names are patched (``CudaRNGStatesTracker``,
``GlobalMemoryBuffer``, ``model_parallel_cuda_manual_seed``), which exist in megatron-core 0.16 and 0.19,
and, for recompute only, the two private RNG helpers of item 5, each only where the release has it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):  # a bare index means a CUDA ordinal to torch
        return True
    return device is not None and "cuda" in str(device)


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA allocations to the CPU inside megatron-core on a CUDA-less process."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            return _backward_on_cpu(func, args, kwargs)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _backward_on_cpu(func: Callable, args: Any, kwargs: dict) -> Any:
    """Shim 6: run a backward with ``torch.cuda.current_device()`` answering "cpu".

    torch takes a mode off its stack while the mode's handler runs, and a backward entered through
    ``torch.autograd.backward`` / ``Tensor.backward`` runs inside that handler, so every op of it runs
    without :class:`CudaToCpuMode`. The allocations megatron makes in backward (sequence
    parallelism's reduce-scatter and all-gather outputs, ``device=torch.cuda.current_device()``) would
    then go to CUDA; for the duration of the backward the device they name is the CPU instead.
    (A backward started from the C++ engine directly keeps the mode and needs nothing.)
    """
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        return func(*args, **kwargs)
    finally:
        torch.cuda.current_device = current


@contextlib.contextmanager
def _no_fork(self: Any, name: str = "model-parallel-rng") -> Iterator[None]:
    yield


def _no_add(self: Any, name: str, seed: int) -> None:
    return None


def _cpu_get_tensor(self: Any, tensor_shape, dtype, name, mem_alloc_context=None):
    required = 1
    for dim in tensor_shape:
        required *= dim
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device="cpu")
    return buf[:required].view(*tensor_shape)


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def _no_synchronize(device: Any = None) -> None:
    return None


def _cpu_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
    torch.manual_seed(seed)


@dataclass
class CpuShims:
    """Handle on the applied patches; ``remove()`` restores every original."""

    _restore: list[Callable[[], None]] = field(default_factory=list)
    _mode: CudaToCpuMode | None = None

    def patch(self, owner: Any, name: str, value: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._restore.append(lambda: setattr(owner, name, original))

    def remove(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        while self._restore:
            self._restore.pop()()


def apply_cpu_shims() -> CpuShims:
    """Patch megatron-core's CUDA assumptions for this CPU-only process (see module docstring)."""
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims() is for CUDA-less processes; this one sees a GPU")
    from megatron.core import tensor_parallel, utils
    from megatron.core.tensor_parallel import random as tp_random

    shims = CpuShims()
    shims.patch(utils.GlobalMemoryBuffer, "get_tensor", _cpu_get_tensor)
    shims.patch(tp_random.CudaRNGStatesTracker, "fork", _no_fork)
    shims.patch(tp_random.CudaRNGStatesTracker, "add", _no_add)
    shims.patch(tp_random, "model_parallel_cuda_manual_seed", _cpu_manual_seed)
    shims.patch(tensor_parallel, "model_parallel_cuda_manual_seed", _cpu_manual_seed)
    # Private, so only where this release has them (0.16 does; recompute needs them on CPU).
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        if hasattr(tp_random, name):
            shims.patch(tp_random, name, _no_cuda_rng_state)
    shims.patch(torch.cuda, "current_device", lambda: 0)
    shims.patch(torch.cuda, "synchronize", _no_synchronize)
    # Module-wide on purpose: the CUDA literals sit in megatron's optimizer, clip_grads and DDP
    # buffers; on a CUDA-less build every one of them would raise, so redirecting is strictly safer.
    shims._mode = CudaToCpuMode()
    shims._mode.__enter__()
    log.debug("megatron-core CPU shims applied")
    return shims


class _OneByOne:
    """Stand-in for ``torch.distributed._coalescing_manager``: lets each collective run on its own.

    ProcessGroupGloo has no ``allreduce_coalesced`` for CUDA tensors, but plain ``all_reduce`` of a
    CUDA tensor works; megatron's DDP only coalesces for speed, so issuing the bucket all-reduces
    one by one computes the same sums.
    """

    def __init__(self, group: Any = None, device: Any = None, async_ops: bool = False) -> None:
        self.works: list[Any] = []

    def __enter__(self) -> _OneByOne:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def append(self, work: Any) -> None:
        self.works.append(work)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def apply_gloo_cuda_shims() -> CpuShims:
    """Let megatron-core run on CUDA tensors over a gloo default group (``--distributed-backend gloo``).

    That is how several ranks share ONE GPU (NCCL refuses two ranks on one device), which lets a
    single-GPU machine run the pipeline runtime with the CUDA IPC transport. The only blocker found
    (megatron-core 0.19.2, torch 2.11) is the coalesced grad all-reduce in its DDP buckets.
    """
    from megatron.core.distributed import param_and_grad_buffer

    shims = CpuShims()
    shims.patch(param_and_grad_buffer, "_coalescing_manager", _OneByOne)
    log.debug("megatron-core gloo-on-CUDA shims applied")
    return shims


@contextlib.contextmanager
def torch_adam_distributed_optimizer_load(optimizer: Any) -> Iterator[None]:
    """Around ``optimizer.load_state_dict``: megatron-core's distributed optimizer loading into torch's
    own Adam (what megatron-core drives without Apex or Transformer Engine, so every CPU run).

    Two faults of megatron-core (0.16) on that path, both around Adam's per-parameter ``step``:

    * it restores ``step`` from the saved param groups, then copies the loaded tensors into each
      parameter's optimizer state by the state's own keys; torch's Adam keeps ``step`` there and the
      loaded tensors of the fully reshardable form never carry it, so the copy raises ``KeyError: 'step'``,
      while those of the dp_reshardable form carry the loading optimizer's own pre-load step (0), whose copy
      restarts the bias correction. For the duration, the copy runs with ``step`` taken out of the state
      and of the loaded tensors, and the value restored from the param groups is put back;
    * it gives every parameter the SAME ``step`` tensor, which torch's Adam then increments in place
      once per parameter per step: the bias correction runs ahead and a resumed run drifts from the
      uninterrupted one. On exit each parameter gets its own copy.

    States without ``step`` (fused Adams) are untouched; patched only where the release has the method.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = getattr(DistributedOptimizer, "_set_main_param_and_optimizer_states", None)

    def set_states(self: Any, model_param: Any, tensors: dict) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param] if main_param in self.optimizer.state else {}
        step = state.pop("step") if "step" in state else None
        # The step restored from the param groups is the one to keep: the dp_reshardable form (Megatron-LM's
        # default) hands back, as 'step', the loading optimizer's own pre-load value (a LocalNonpersistentObject,
        # 0 on a fresh optimizer), whose copy would restart Adam's bias correction.
        tensors = {k: v for k, v in tensors.items() if k != "step"}
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    if original is not None:
        DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        if original is not None:
            DistributedOptimizer._set_main_param_and_optimizer_states = original
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if isinstance(sub, DistributedOptimizer) and isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()


@contextlib.contextmanager
def fully_reshardable_bucket_offsets() -> Iterator[None]:
    """Around ``optimizer.sharded_state_dict`` for a save in the distributed optimizer's fully reshardable
    form: each parameter's saved state read at the parameter's own place.

    megatron-core (0.16) gathers the state into one tensor per buffer with each bucket's end padding
    left out (``get_parameter_state_dp_zero``), then cuts every parameter out of it at its offset in
    the *padded* buffer (``param_index_map``): every parameter after a bucket whose end was padded is
    read from a later position, its tail past the end filled with zeros (megatron logs a warning only
    when it runs off the end). The state of those parameters is saved wrong and a resumed run departs
    from the uninterrupted one. Several buckets are the rule in a large model; the distributed optimizer
    always gives the shared embedding its own bucket, so a pipeline's first and last stages hit it at
    any size, wherever their other parameters do not fill whole 128-element blocks (a stage boundary
    after a layer's attention, say).

    For the duration, megatron's result is corrected: each parameter's tensors are cut again from the
    same gathered tensors at ``offset in its bucket + unpadded sizes of the buckets before``. A release
    that cuts them right (Megatron-LM's fix subtracts the padding) gets the same values written again.
    A gathered tensor of another size than the buffer's unpadded one is left alone, and logged.
    megatron's own warning of a parameter run off the end ("padded with zeros") is dropped meanwhile:
    the recut replaces what it warns of.
    """
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = getattr(DistributedOptimizer, "sharded_param_state_fully_reshardable", None)
    if original is None or not hasattr(DistributedOptimizer, "get_parameter_state_dp_zero"):
        yield
        return

    def sharded(self: Any, model_sharded_state_dict: Any, is_loading: bool = False,
                metadata: dict | None = None) -> Any:
        gathered: list[Any] = []
        gather = self.get_parameter_state_dp_zero

        def keep(*args: Any, **kwargs: Any) -> Any:
            gathered.append(gather(*args, **kwargs))
            return gathered[-1]

        self.get_parameter_state_dp_zero = keep  # an instance attribute: megatron calls it through self
        try:
            state = original(self, model_sharded_state_dict, is_loading=is_loading, metadata=metadata)
        finally:
            del self.get_parameter_state_dp_zero
        if not is_loading and state is not None and gathered and gathered[0] is not None:
            _recut_fully_reshardable(self, state, gathered[0])
        return state

    megatron_log = getattr(distrib_optimizer, "logger", logging.getLogger(distrib_optimizer.__name__))
    recut = _DropMessage("param range exceeds unpadded buffer")
    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded
    megatron_log.addFilter(recut)
    try:
        yield
    finally:
        DistributedOptimizer.sharded_param_state_fully_reshardable = original
        megatron_log.removeFilter(recut)


class _DropMessage(logging.Filter):
    """Drops the records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _recut_fully_reshardable(optimizer: Any, state: dict, gathered: dict) -> None:
    """Replace the data of ``state`` (megatron's per-parameter sharded tensors, numbered in its order:
    buffers, then each buffer's ``param_index_map``) with the right slices of ``gathered``."""
    index = 0
    for gbuf_idx, ranges in enumerate(optimizer.gbuf_ranges):
        buffer = optimizer.buffers[gbuf_idx]
        unpadded_before, total = [], 0
        for bucket in buffer.buckets:
            unpadded_before.append(total)
            total += bucket.numel_unpadded
        for dtype in ranges:
            world = gathered[gbuf_idx][dtype]
            tensors = {k: v for k, v in world.items() if torch.is_tensor(v) and v.dim() == 1}
            usable = all(len(v) == total for v in tensors.values())
            if not usable:
                log.warning("distributed optimizer state gathered as %s elements, the buffer holds %d unpadded: "
                            "saved as megatron-core cut it", sorted({len(v) for v in tensors.values()}), total)
            for start, end, bucket_id in buffer.param_index_map.values():
                at = start - buffer.buckets[bucket_id].offset + unpadded_before[bucket_id]
                for key, sharded in state[index].items():
                    if usable and key in tensors:
                        sharded.data = tensors[key][at:at + end - start].reshape(sharded.data.shape)
                index += 1
