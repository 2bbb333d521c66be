"""Megatron's gradient-synchronisation protocol for a schedule whose order is not known in advance.

Megatron-core's schedules enter ``config.no_sync_func()`` for every backward but the last one of each
model chunk, leave it right before that last backward (so DDP's hooks reduce the now-complete
gradients, overlapped with the remaining backwards when ``overlap_grad_reduce`` is on), call
``config.grad_sync_func[chunk]`` once a chunk is done, and finally ``finalize_model_grads_func``.
With a dynamic schedule "the last backward of chunk c" is simply the M-th backward of chunk c to
run, whichever microbatch that is, so we count. With a split backward (I then W) the runtime calls
``before_backward``/``after_backward`` around each W instead: a chunk's weight gradients are complete
only after its M-th W, so I steps run entirely under ``no_sync``.
"""

from __future__ import annotations

import contextlib
from typing import Any


class GradSync:
    """Context manager around one step: ``before_backward``/``after_backward`` around every backward."""

    def __init__(self, config: Any, chunks: list, num_microbatches: int, forward_only: bool) -> None:
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
        if not self.enabled:
            return
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
        if was_last and self.grad_sync_funcs is not None:
            self.grad_sync_funcs[chunk](self.chunks[chunk].parameters())
