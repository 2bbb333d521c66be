"""Transient stalls injected into one rank's forward steps, the same ones under every schedule.

``--inject-stalls RANK:FRACTION:MILLISECONDS[:SEED]`` delays about FRACTION of the forward steps of
global rank RANK by MILLISECONDS each (the benchmark's scenario (c): a straggling GPU, a noisy neighbour).

Why the forward step function: it is the one callable both megatron-core's schedules and our DPP
runtime call for every microbatch and chunk, with the same ``(data_iterator, model)`` arguments, so
wrapping it treats every schedule alike. Only forwards are delayed; backwards are not (megatron's
schedules call autograd directly, with no per-op hook to wrap).

Which ops: forward ``(iteration, chunk, microbatch)`` is delayed iff a hash of (seed, iteration,
chunk, microbatch) falls under FRACTION -- a function of the op, not of execution order, so a
static and a dynamic schedule delay exactly the same ops. The microbatch of a call is its position
among this step's forward calls of that chunk: every schedule here runs a chunk's forwards in
microbatch order (megatron's by construction; ours because each stage receives activations in
FIFO order per edge and the policies take the oldest ready microbatch).

How: on CUDA, ``torch.cuda._sleep(cycles)`` (a spin kernel; cycles per ms calibrated once with CUDA
events) is queued on the current stream before the forward's kernels, so the GPU stalls while the
host runs ahead as it would behind a slow kernel; on CPU, ``time.sleep``.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.problems import raise_if_any

FLAG = "--inject-stalls"


@dataclass(frozen=True)
class StallSpec:
    """Parsed ``RANK:FRACTION:MILLISECONDS[:SEED]``."""

    rank: int
    """Global rank whose forward steps are delayed."""
    fraction: float
    """Share of that rank's forward ops to delay, in [0, 1]."""
    milliseconds: float
    """Delay per chosen op."""
    seed: int = 0
    """Picks which ops; the same seed delays the same ops under every schedule."""

    def delays(self, iteration: int, chunk: int, microbatch: int) -> bool:
        """Whether forward (iteration, chunk, microbatch) is delayed: order-independent."""
        digest = hashlib.blake2b(f"{self.seed}:{iteration}:{chunk}:{microbatch}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.fraction


def stall_problems(text: str | None) -> list[str]:
    """Every problem of an ``--inject-stalls`` value (empty: fine or not given)."""
    if text is None:
        return []
    parts = text.split(":")
    if len(parts) not in (3, 4):
        return [f"{FLAG}={text!r} must be RANK:FRACTION:MILLISECONDS[:SEED]"]
    problems = []
    names = ("RANK", "FRACTION", "MILLISECONDS", "SEED")
    kinds = (int, float, float, int)
    values: list[Any] = []
    for name, kind, part in zip(names, kinds, parts, strict=False):
        try:
            values.append(kind(part))
        except ValueError:
            problems.append(f"{FLAG}={text!r}: {name}={part!r} is not a{'n integer' if kind is int else ' number'}")
            values.append(None)
    rank, fraction, ms = values[:3]
    if rank is not None and rank < 0:
        problems.append(f"{FLAG}={text!r}: RANK={rank} must be >= 0")
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        problems.append(f"{FLAG}={text!r}: FRACTION={fraction} must be in [0, 1]")
    if ms is not None and ms < 0:
        problems.append(f"{FLAG}={text!r}: MILLISECONDS={ms} must be >= 0")
    return problems


def parse_stall_spec(text: str) -> StallSpec:
    """``StallSpec`` of a valid value; ValueError naming every problem otherwise."""
    problems = stall_problems(text)
    raise_if_any(problems)
    parts = text.split(":")
    return StallSpec(int(parts[0]), float(parts[1]), float(parts[2]), int(parts[3]) if len(parts) == 4 else 0)


def _cuda_sleeper() -> Callable[[float], None]:
    """``sleep(ms)`` that queues a spin kernel on the current CUDA stream (calibrated once here)."""
    import torch

    probe = 20_000_000
    torch.cuda._sleep(1000)  # warm the kernel up before timing it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    cycles_per_ms = probe / max(start.elapsed_time(end), 1e-3)
    return lambda ms: torch.cuda._sleep(int(ms * cycles_per_ms))


@dataclass
class StallInjector:
    """Wraps a forward step function; counts calls per (iteration, chunk) to name each op."""

    spec: StallSpec
    chunks: list
    """The model chunks the schedule passes as ``model`` (identified by object identity)."""
    sleep: Callable[[float], None] = field(default=lambda ms: time.sleep(ms / 1000.0))
    """Delays by ``ms`` milliseconds: the thread by default, the CUDA stream from :func:`make_stall_injector`."""
    iteration: int = 0
    delayed: list[tuple[int, int, int]] = field(default_factory=list)
    """(iteration, chunk, microbatch) of every op delayed so far."""
    _calls: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def set_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self._calls.clear()

    def _chunk_of(self, model: Any) -> int:
        model = getattr(model, "stands_for", model)  # a CUDA-graph replay of a chunk (--dpp-cuda-graphs)
        for index, chunk in enumerate(self.chunks):
            if chunk is model:
                return index
        return 0

    def wrap(self, forward_step: Callable) -> Callable:
        def delayed_forward_step(data_iterator, model, *args, **kwargs):
            chunk = self._chunk_of(model)
            microbatch = self._calls[chunk]
            self._calls[chunk] += 1
            if self.spec.delays(self.iteration, chunk, microbatch):
                self.delayed.append((self.iteration, chunk, microbatch))
                self.sleep(self.spec.milliseconds)
            return forward_step(data_iterator, model, *args, **kwargs)

        return delayed_forward_step


def make_stall_injector(spec: StallSpec, chunks: list, device_type: str) -> StallInjector:
    """An injector whose delay stalls the GPU stream on CUDA and the thread on CPU."""
    if device_type == "cuda":
        return StallInjector(spec, chunks, sleep=_cuda_sleeper())
    return StallInjector(spec, chunks)
