"""Microbatches on the GPU ahead of use, without the host ever waiting for a transfer.

A pageable ``tensor.to("cuda")`` blocks the host until the copy is done, so every forward that fetched
its microbatch that way stalled the host that should be queueing the next kernels (seen as a gap
after nearly every op on 4 GPUs). Here the host builds microbatch ``m`` in pinned memory and issues
its copies with ``non_blocking=True`` on a side stream, ``depth`` microbatches ahead of the one being
used; the consumer's stream waits on an event, never the host. The pinned buffers stay alive (and the
caching host allocator will not reuse them) until the copy that reads them has finished.

On CPU there is nothing to overlap: ``get`` builds the microbatch when asked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HostBatch = Callable[[int], dict[str, torch.Tensor]]
"""microbatch index -> that microbatch's tensors on the host (CPU)."""


class MicrobatchPrefetcher:
    """``get(m)``: microbatch ``m`` of the current step on ``device``; ``begin_step`` between steps."""

    def __init__(self, host_batch: HostBatch, device: torch.device, depth: int = 2) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth={depth} must be >= 0")
        self._host_batch, self._device, self._depth = host_batch, device, depth
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._issued: dict[int, tuple[dict[str, torch.Tensor], torch.cuda.Event | None]] = {}
        self._num_microbatches = 0

    def begin_step(self, num_microbatches: int) -> None:
        """Forget what the last step issued (its data belongs to other samples) and start this one's."""
        self._issued.clear()
        self._num_microbatches = num_microbatches
        for m in range(min(self._depth, num_microbatches)):
            self._issue(m)

    def get(self, microbatch: int) -> dict[str, torch.Tensor]:
        if not 0 <= microbatch < self._num_microbatches:
            raise IndexError(f"microbatch {microbatch} outside [0, {self._num_microbatches}) of this step")
        for m in range(microbatch, min(microbatch + self._depth + 1, self._num_microbatches)):
            self._issue(m)
        batch, ready = self._issued[microbatch]
        if ready is not None:
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_event(ready)
            for tensor in batch.values():
                tensor.record_stream(consumer)  # allocated on the side stream, used on the consumer's
        return batch

    def _issue(self, microbatch: int) -> None:
        if microbatch in self._issued:
            return
        host = self._host_batch(microbatch)
        if not self._cuda:
            self._issued[microbatch] = ({k: t.to(self._device) for k, t in host.items()}, None)
            return
        with torch.cuda.stream(self._stream):
            batch = {k: t.pin_memory().to(self._device, non_blocking=True) for k, t in host.items()}
            ready = torch.cuda.Event()
            ready.record(self._stream)
        self._issued[microbatch] = (batch, ready)
