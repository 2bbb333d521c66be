"""How far a stage's host may run ahead of its GPU (``--dpp-max-queued-ops K``).

Why: the runtime decides the next op as soon as the last one is queued, and an input counts as
ready when its header arrives, which the sender posts when it *queues* the producing op. With CUDA
graphs a host queues ops far faster than its GPU runs them, so the policy decides at host time on
inputs that will exist only later on the GPU, and one stream runs the ops in decision order: a
forward whose activation is still being computed upstream holds back a backward whose gradient is
already there (head-of-line blocking). On a 4×H100 host where megatron-core's eager stage 0 is not
launch-bound, DPP's stages idled between ops in the second half of every step (measured on
4xH100). The simulator, which decides at GPU time, does not see this.

Measured (4xH100, the benchmark model gpt16-h2048, one call; docs/schedules.md, "Per-hop latency"): with CUDA graphs at 1F1B's
caps 559 ms per iteration unbounded, 526 at K = 2, 482 at K = 1; so K = 1 is the default with
``--dpp-cuda-graphs`` (eager DPP stays unbounded until measured). The host-time simulator
(trainer/schedule/host_ahead.py) had predicted no gain: the real cost of deciding early is not in
that model yet (docs/schedules.md).

With K > 0 the host decides only once at most K of the ops it queued have not finished on the GPU,
so decisions are taken close to GPU time (K ops of 3–10 ms each still hide the launch of the next
one). K = 0 keeps the host unbounded (the behaviour before this option). CPU ops are synchronous:
the bound never waits there.

Never hangs: a wait longer than the watchdog timeout raises :class:`DppStallError` naming the rank
and the op the GPU has not finished. Cannot deadlock: every op the host waits for was queued after
the headers of the inputs it reads had arrived, i.e. after their producers were queued on the
neighbours' streams, so the wait depends only on work already queued somewhere.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from trainer.pipeline.stall import DppStallError

POLL_S = 20e-6
"""Sleep between two looks at an unfinished op (an op takes milliseconds)."""


class RunAheadBound:
    """``before_decide()`` waits until at most ``limit`` queued ops are unfinished on the GPU;
    ``after_op(name)`` marks the end of the op just queued on the current stream."""

    def __init__(self, limit: int, rank: int, timeout_s: float, make_event: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if limit < 0:
            raise ValueError(f"--dpp-max-queued-ops={limit} must be >= 0")
        self.limit, self.rank, self.timeout_s = limit, rank, timeout_s
        self._make_event, self._clock, self._sleep = make_event, clock, sleep
        self._queued: collections.deque[tuple[str, Any]] = collections.deque()
        self.waited_s = 0.0
        """Host time spent waiting in this step (for logs and traces)."""
        self.total_waited_s = 0.0
        """... and over the whole run (the end-of-run log line)."""

    @classmethod
    def for_device(cls, limit: int, rank: int, timeout_s: float, device: Any) -> RunAheadBound:
        """The bound of a stage on ``device`` (a torch.device): CUDA events there, none on CPU."""
        make_event = None
        if limit > 0 and getattr(device, "type", "cpu") == "cuda":
            import torch

            def make_event() -> Any:
                event = torch.cuda.Event()
                event.record()  # on the current stream, after the op just queued
                return event
        return cls(limit, rank, timeout_s, make_event)

    @property
    def active(self) -> bool:
        return self._make_event is not None

    def begin_step(self) -> None:
        self._queued.clear()
        self.waited_s = 0.0

    def after_op(self, name: str) -> None:
        if self._make_event is not None:
            self._queued.append((name, self._make_event()))

    def before_decide(self) -> None:
        if self._make_event is None:
            return
        while self._queued and self._queued[0][1].query():
            self._queued.popleft()
        if len(self._queued) <= self.limit:
            return
        start = self._clock()
        deadline = start + self.timeout_s
        while len(self._queued) > self.limit:
            name, event = self._queued[0]
            if event.query():
                self._queued.popleft()
                continue
            if self._clock() > deadline:
                raise DppStallError(
                    f"DPP: rank {self.rank} waited {self.timeout_s:.0f}s for its GPU to finish {name} "
                    f"(--dpp-max-queued-ops {self.limit}: {len(self._queued)} queued ops unfinished); "
                    "the GPU is stuck, most likely on an input that never arrived")
            self._sleep(POLL_S)
        waited = self._clock() - start
        self.waited_s += waited
        self.total_waited_s += waited
