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

import gc
import logging
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
