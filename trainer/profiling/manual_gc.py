"""Megatron-LM's ``--manual-gc``: Python's garbage collector on a schedule shared by all ranks.

A rank that pauses for an automatic collection holds up every peer waiting on it in the pipeline or
in a collective, and each rank pauses at moments of its own. With ``--manual-gc`` (Megatron-LM's
``train()``) the automatic collector is switched off when training starts, after one full
collection; from then on the only collections are where every rank is at the same point of the
same iteration:

* with ``--manual-gc-interval N > 0``: a full collection after every iteration whose number (counted
  from 1, after the step) is a multiple of N -- after that iteration's evaluation, before its
  checkpoint, as Megatron-LM's post-training-step callbacks run;
* unless ``--no-manual-gc-eval``: a full collection right before each evaluation and a collection of
  the youngest generation (what the evaluation itself created) right after it.

:meth:`ManualGC.stop` re-enables the collector if :meth:`ManualGC.start` switched it off, so that a
caller running training in-process gets its interpreter back as it was.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ManualGC:
    """The collection schedule of one rank (no-ops unless ``enabled``)."""

    enabled: bool = False
    interval: int = 0
    around_eval: bool = True
    collector: Any = field(default=gc)
    """The ``gc`` module (tests pass a recorder with the same ``disable/enable/isenabled/collect``)."""
    _was_enabled: bool | None = None

    @classmethod
    def from_config(cls, run_config: Any, collector: ModuleType | Any = gc) -> ManualGC:
        return cls(enabled=run_config.manual_gc, interval=run_config.manual_gc_interval,
                   around_eval=run_config.manual_gc_eval, collector=collector)

    def start(self) -> None:
        """Training starts: automatic collection off, then one full collection (Megatron-LM's order)."""
        if not self.enabled:
            return
        self._was_enabled = self.collector.isenabled()
        self.collector.disable()
        self.collector.collect()

    def before_eval(self) -> None:
        if self.enabled and self.around_eval:
            self.collector.collect()

    def after_eval(self) -> None:
        if self.enabled and self.around_eval:
            self.collector.collect(generation=0)

    def after_iteration(self, iteration: int) -> None:
        """``iteration`` = iterations done so far (1 after the first step)."""
        if self.enabled and self.interval > 0 and iteration % self.interval == 0:
            self.collector.collect()

    def stop(self) -> None:
        """Training is over: give the interpreter its automatic collector back if it had one."""
        if self._was_enabled:
            self.collector.enable()
        self._was_enabled = None


class GcTimer:
    """Times each Python collection while installed (``gc.callbacks``: a start and a stop call per
    collection, on whichever thread triggered it) and hands it to ``on_collection(generation,
    start_us, end_us, collected)``, µs on ``time.time_ns`` (the tracer's clock). What the
    end-of-run line (:class:`GcPauses`) and the traces' "gc" spans (trainer/profiling/tracer.py) share."""

    def __init__(self, on_collection: Callable[[int, float, float, int], None]) -> None:
        self._on_collection = on_collection
        self._start_us: float | None = None
        self.installed = False

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self._on_gc)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._on_gc)
            self.installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start_us = time.time_ns() / 1000.0
        elif self._start_us is not None:
            start, self._start_us = self._start_us, None
            self._on_collection(int(info.get("generation", -1)), start, time.time_ns() / 1000.0,
                                int(info.get("collected", 0)))


@dataclass
class GcPauses:
    """Python's collections while a training step runs, for the end-of-run log line: a collection
    stops this rank's host wherever it falls (a gen-2 pass over a model's objects takes milliseconds),
    and a pipeline stage whose host stops holds up its neighbours. Timed by a :class:`GcTimer`;
    ``--manual-gc`` leaves none inside a step."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    """Collections inside steps, by generation."""
    total_s: float = 0.0
    longest_s: float = 0.0
    longest_generation: int = -1
    _in_step: bool = False
    _timer: GcTimer = field(init=False)

    def __post_init__(self) -> None:
        self._timer = GcTimer(self._collected)

    def install(self) -> None:
        self._timer.install()

    def uninstall(self) -> None:
        self._timer.uninstall()

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def _collected(self, generation: int, start_us: float, end_us: float, _collected: int) -> None:
        if not self._in_step:
            return
        took = (end_us - start_us) / 1e6
        self.count[min(max(generation, 0), 2)] += 1
        self.total_s += took
        if took > self.longest_s:
            self.longest_s, self.longest_generation = took, generation

    def summary(self, manual: bool, hint_ms: float = 1.0) -> str:
        """The log line's text (after "stage N: "); it points to --manual-gc where a collection inside
        a step took ``hint_ms`` or longer (a pause a pipeline neighbour feels)."""
        n = sum(self.count)
        text = (f"{n} garbage collection(s) ran inside training steps (generation 0/1/2: "
                f"{'/'.join(map(str, self.count))}), {1e3 * self.total_s:.1f} ms in all")
        if n:
            text += f", longest {1e3 * self.longest_s:.1f} ms (generation {self.longest_generation})"
            if not manual and 1e3 * self.longest_s >= hint_ms:
                text += "; --manual-gc runs them between steps instead (Megatron-LM)"
        return text
