"""``--dpp-cuda-graphs``: replay each non-last chunk's forward and backward from CUDA graphs.

Why: on the issue-12 model (GPT h2048, mbs 2, megatron-core's local layer spec, no Transformer
Engine) a stage's forward is launch-bound -- its host span (~7 ms on 4x H100) is longer than the
kernels it launches, so the GPU idles inside every forward; the trace showed stage 0's ops taking
618 ms of GPU window per iteration for 454 ms of kernels. A graph replay launches a whole chunk with
one call, so the forward becomes GPU-bound and the host runs ahead.

Why one graph pair per *slot*: a captured forward keeps its activations in the graph's private
memory until the matching backward replays. The dynamic schedule runs up to its in-flight cap of
forwards before their backwards, in any order, so every in-flight microbatch needs a graph pair of
its own. F(m) takes a free slot, B(m) gives it back once its backward replay is queued (later replays
on the same stream run after it). With no free slot, or an input whose shape was not captured, the
op runs eagerly -- always correct, only slower.

Scope (checked by the config before any process starts): GPT, --use-dpp with --dpp-policy dpp (a
graph's backward is one piece, so split backward cannot defer its weight GEMMs), fixed sequence
length, dropout 0 (a captured dropout would need megatron's graph-safe RNG tracker; with p = 0 no
random numbers are drawn, and the tracker's fork is bypassed while capturing). The last stage stays
eager: its head and loss are outside the graph, and it is the lightest stage of the split on the
host anyway.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class _ChunkCall(torch.nn.Module):
    """The callable a slot captures: one chunk's transformer layers from its input activation (graphs
    take tensors only).

    Later stages get the received activation the Megatron way (set_input_tensor). The first stage's
    embedding stays outside the graph -- its CUDA backward reads the number of distinct token ids back
    to the host, which a capture forbids -- and its output comes in as GPTModel's ``decoder_input``."""

    def __init__(self, chunk: torch.nn.Module, first: bool) -> None:
        super().__init__()
        # make_graphed_callables differentiates w.r.t. this module's parameters(): register only the
        # transformer block, which the graph uses entirely. An unused parameter (the first stage's
        # embedding, run outside the graph) broke the backward capture: autograd synchronised its
        # never-produced gradient with the legacy default stream, which a capture forbids.
        self.decoder = _unwrapped(chunk).decoder
        self._chunk = (chunk,)  # called, not registered
        self.first = first

    @property
    def chunk(self) -> torch.nn.Module:
        return self._chunk[0]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from megatron.core.utils import get_attr_wrapped_model

        if self.first:
            get_attr_wrapped_model(self.chunk, "set_input_tensor")([None])
            return self.chunk(None, position_ids, attention_mask, decoder_input=x)
        get_attr_wrapped_model(self.chunk, "set_input_tensor")([x])
        return self.chunk(None, position_ids, attention_mask)


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # megatron's DDP, then Float16Module with --bf16/--fp16
        chunk = chunk.module
    return chunk


@dataclass(frozen=True)
class GraphShapes:
    """What a slot is captured for: the chunk input's shape and dtype, and the microbatch's [b, s]."""

    activation: tuple[int, ...]  # [s, b, h] of the received activation (later stages)
    activation_dtype: torch.dtype
    tokens: tuple[int, int]  # [b, s]


@contextlib.contextmanager
def _rng_fork_bypassed() -> Iterator[None]:
    """megatron's CUDA RNG tracker saves and restores the generator around attention dropout; setting a
    generator's state is not allowed while a graph is being captured. With dropout 0 nothing is drawn
    in between, so the fork is skipped for the capture (replays never run Python)."""
    from megatron.core.tensor_parallel import random as tp_random

    original = tp_random.CudaRNGStatesTracker.fork
    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    try:
        yield
    finally:
        tp_random.CudaRNGStatesTracker.fork = original


class ChunkGraphs:
    """The graph slots of one model chunk."""

    def __init__(self, chunk: torch.nn.Module, first: bool, slots: int, shapes: GraphShapes,
                 attention_mask: torch.Tensor, device: torch.device, capture=None) -> None:
        """``capture``: torch.cuda.make_graphed_callables unless given (the CPU tests pass one that
        returns the module uncaptured, to check everything around the graphs without a GPU)."""
        capture = capture or torch.cuda.make_graphed_callables
        if slots < 1:
            raise ValueError(f"need at least one graph slot, got {slots}")
        self.first, self.shapes = first, shapes
        self.embedding = _unwrapped(chunk).embedding if first else None  # eager on the first stage
        b, s = shapes.tokens
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s).contiguous()
        self.calls = []
        with _rng_fork_bypassed():
            for _ in range(slots):
                x = torch.zeros(shapes.activation, dtype=shapes.activation_dtype, device=device,
                                requires_grad=True)
                # Each slot its own module object: make_graphed_callables replaces the module's forward.
                call = capture(_ChunkCall(chunk, first), (x, position_ids, attention_mask),
                               allow_unused_input=True)
                self.calls.append(call)
        self._free = list(range(slots))[::-1]
        self._taken: dict[int, int] = {}
        self.replayed = self.eager = 0  # forwards of training steps, for the end-of-run log

    @property
    def slots(self) -> int:
        return len(self.calls)

    def matches(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (tokens on the first stage, the activation elsewhere) has the captured shape."""
        if self.first:
            return tuple(x.shape) == self.shapes.tokens
        return tuple(x.shape) == self.shapes.activation and x.dtype == self.shapes.activation_dtype

    def take(self, microbatch: int, x: torch.Tensor) -> _ChunkCall | None:
        """A free slot's graphed callable for this microbatch's forward; None = run it eagerly."""
        if not torch.is_grad_enabled():
            return None
        if not self._free or not self.matches(x):
            self.eager += 1
            return None
        self.replayed += 1
        slot = self._free.pop()
        self._taken[microbatch] = slot
        return self.calls[slot]

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's embedding, run eagerly ([s, b, h], what the graph takes as input)."""
        return self.embedding(input_ids=tokens, position_ids=position_ids)

    def give_back(self, microbatch: int) -> None:
        """After the microbatch's backward was queued (no-op for one that ran eagerly)."""
        slot = self._taken.pop(microbatch, None)
        if slot is not None:
            self._free.append(slot)

    def in_use(self) -> list[int]:
        return sorted(self._taken)


class Replay:
    """What the forward step function receives as ``model`` for a graphed forward: called like the
    megatron chunk (tokens, position_ids, attention_mask, labels=...), it replays the slot instead.
    Labels are ignored: only chunks without the output head are graphed. ``stands_for`` is the chunk
    it replaces (wrappers of the forward step that tell chunks apart, e.g. stall injection, read it)."""

    def __init__(self, graphs: ChunkGraphs, call: _ChunkCall, input_tensor: torch.Tensor | None,
                 stands_for: torch.nn.Module) -> None:
        self.graphs, self.call, self.input_tensor, self.stands_for = graphs, call, input_tensor, stands_for

    def __call__(self, tokens, position_ids, attention_mask, labels=None, **kwargs) -> torch.Tensor:
        x = self.graphs.embed(tokens, position_ids) if self.graphs.first else self.input_tensor
        return self.call(x, position_ids, attention_mask)


def run_on_side_stream(device: torch.device) -> torch.cuda.Stream:
    """Make a fresh stream this process's current one; call it before the model is built.

    Why: megatron's DDP creates every parameter's gradient accumulator node at construction, and a
    node remembers the stream that was current then. Built on the legacy default stream, those nodes
    make the backward capture fail ("operation would make the legacy stream depend on a capturing
    blocking stream": autograd records an event on each leaf's stream when it hands back leaf
    gradients). With every op of the run on one ordinary stream, nothing ever touches the legacy one
    and eager steps need no cross-stream synchronisation either."""
    stream = torch.cuda.Stream(device)
    torch.cuda.set_stream(stream)
    return stream


def capture_chunk_graphs(chunks: list, shape, stage: int, slots: int, shapes: GraphShapes,
                         attention_mask: torch.Tensor, device: torch.device) -> dict[int, ChunkGraphs]:
    """Graph slots for each chunk of this stage that does not hold the output head (none on a
    single-stage pipeline). Runs each chunk's forward and backward a few times with zero inputs
    (warm-up and capture, no gradient is accumulated): call it before the first step."""
    graphs = {}
    for c, chunk in enumerate(chunks):
        if shape.is_last_virtual(stage, c):
            continue
        graphs[c] = ChunkGraphs(chunk, shape.is_first_virtual(stage, c), slots, shapes, attention_mask, device)
    torch.cuda.synchronize(device)
    if graphs:
        log.info("stage %d: CUDA graphs for chunk(s) %s, %d slot(s) each", stage, sorted(graphs), slots)
    return graphs
