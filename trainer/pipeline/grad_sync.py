"""Megatron's gradient-synchronisation protocol for a schedule whose order is not known in advance.

Megatron-core's schedules enter ``config.no_sync_func()`` for every backward but the last one of each
model chunk, leave it right before that last backward, call ``config.grad_sync_func[chunk]`` once a
chunk is done, and finally ``finalize_model_grads_func``. With a dynamic schedule "the last backward
of chunk c" is simply the M-th backward of chunk c to run, whichever microbatch that is, so we count.
With a split backward (I then W) the runtime calls ``before_backward``/``after_backward`` around each
W instead: a chunk's weight gradients are complete only after its M-th W, so I steps run entirely
under ``no_sync``.

Overlapped data-parallel reduction (``--overlap-grad-reduce``) is launched by this runtime, not by
megatron DDP's gradient hooks. Why: the hooks cannot tell when a bucket is complete here -- under
split backward they fire during I, before W has added the linears' weight gradients (and megatron's
hook asserts on the missing gradient), and a backward replayed from a CUDA graph runs no hook at all.
The runtime knows: right after the op that completes chunk c's gradients (its M-th B, or its M-th W)
it starts every bucket group of the chunk (megatron's ``_ParamAndGradBucketGroup.start_grad_sync``:
an asynchronous all-reduce, or reduce-scatter with the distributed optimizer); queued on the
compute stream after that op's kernels (or graph replay), so it reads complete gradients, and
overlapping whatever the stage runs next. ``finalize_model_grads`` waits for them
(``finish_grad_sync``) before the optimizer. The chunks' DDP wrappers must be
:func:`runtime_reduced_ddp`'s class, whose hooks only accumulate (``ChunkReduction.supported``).

Order: every DP replica must issue its collectives in the same order, but each replica's policy
decides on its own arrivals. Within a chunk the bucket groups are started in megatron's order (the
list order: last layers first). Between chunks, the chunks are started in a fixed order, v-1 down to
0, a chunk that completes early waiting for the ones before it in that order. Whole backwards
already complete in that order (chunk c's B(m) needs chunk c+1's B(m) on every stage); the deferred
W steps of dpp-zb may not, hence the queue.
"""

from __future__ import annotations

import contextlib
from typing import Any


class ChunkReduction:
    """The runtime's launch of one chunk's data-parallel reduction (``--overlap-grad-reduce``)."""

    def __init__(self, chunk: Any, force_all_reduce: bool) -> None:
        self.bucket_groups = list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups", []))
        self.force_all_reduce = force_all_reduce or bool(getattr(chunk, "force_all_reduce", False))
        self.started = False

    @staticmethod
    def supported(chunk: Any) -> bool:
        """Whether the runtime launches this chunk's reduction: overlapped reduction is on and the
        chunk's DDP hooks leave the launch to us (runtime_reduced_ddp)."""
        ddp_config = getattr(chunk, "ddp_config", None)
        return bool(getattr(ddp_config, "overlap_grad_reduce", False)) and getattr(
            chunk, "reduction_launched_by_runtime", False)

    def start(self) -> None:
        for group in self.bucket_groups:
            group.start_grad_sync(force_all_reduce=self.force_all_reduce)
        self.started = True


class GradSync:
    """Context manager around one step: ``before_backward``/``after_backward`` around every backward."""

    def __init__(self, config: Any, chunks: list, num_microbatches: int, forward_only: bool,
                 force_all_reduce: bool = False) -> None:
        self.chunks = chunks
        self.num_microbatches = num_microbatches
        self.enabled = not forward_only
        self.backwards_done = [0] * len(chunks)
        no_sync = config.no_sync_func
        # A list holds one context factory per chunk; a single callable covers all chunks at once
        # (Megatron's convention for both).
        self.per_chunk = isinstance(no_sync, list)
        self.no_sync_funcs = no_sync if self.per_chunk else [no_sync or contextlib.nullcontext]
        grad_sync = config.grad_sync_func
        if grad_sync is not None and not isinstance(grad_sync, list):
            grad_sync = [grad_sync] * len(chunks)
        self.grad_sync_funcs = grad_sync
        self.open: dict[int, Any] = {}
        # --overlap-grad-reduce: the runtime starts each chunk's reduction (module docstring).
        runtime_launched = self.enabled and all(ChunkReduction.supported(c) for c in chunks)
        self.reductions = [ChunkReduction(c, force_all_reduce) for c in chunks] if runtime_launched else None
        self.complete = [False] * len(chunks)

    def __enter__(self) -> GradSync:
        if self.enabled:
            for i, func in enumerate(self.no_sync_funcs):
                ctx = func()
                ctx.__enter__()
                self.open[i] = ctx
        return self

    def __exit__(self, *exc: object) -> None:
        for i in list(self.open):
            self.open.pop(i).__exit__(None, None, None)

    def _is_last(self, chunk: int) -> bool:
        return self.backwards_done[chunk] == self.num_microbatches - 1

    def before_backward(self, chunk: int) -> None:
        if not self.enabled or self.reductions is not None:
            return  # runtime-launched reductions: no_sync stays on, the hooks only accumulate
        key = chunk if self.per_chunk else 0
        last = self._is_last(chunk) if self.per_chunk else (
            sum(self.backwards_done) == self.num_microbatches * len(self.chunks) - 1)
        if last and key in self.open:
            self.open.pop(key).__exit__(None, None, None)

    def after_backward(self, chunk: int) -> None:
        if not self.enabled:
            return
        was_last = self._is_last(chunk)
        self.backwards_done[chunk] += 1
        if not was_last:
            return
        if self.reductions is not None:
            self.complete[chunk] = True
            self._start_complete_chunks()
        if self.grad_sync_funcs is not None:
            self.grad_sync_funcs[chunk](self.chunks[chunk].parameters())

    def _start_complete_chunks(self) -> None:
        """Start the complete chunks' reductions in the fixed order v-1 .. 0 (module docstring)."""
        for c in reversed(range(len(self.chunks))):
            reduction = self.reductions[c]
            if reduction.started:
                continue
            if not self.complete[c]:
                return
            reduction.start()

    @property
    def reductions_started(self) -> list[bool]:
        """Per chunk, whether the runtime started its reduction this step (empty: the runtime launches none)."""
        return [r.started for r in self.reductions] if self.reductions is not None else []
