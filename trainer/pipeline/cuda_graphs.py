"""``--dpp-cuda-graphs``: replay each chunk's transformer block, forward and backward, from CUDA graphs.

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

What is graphed: each chunk's transformer block (its layers, and the final norm on the last stage),
nothing else. The chunk's own forward (GPTModel.forward behind megatron's wrappers) still runs
eagerly and calls its block as always; for a graphed op the block's forward is swapped, for that
call only, for the slot's replay. So the first stage's embedding stays eager (its CUDA backward reads
the number of distinct token ids back to the host, which a capture forbids), and so do the last
stage's output layer and loss; everything megatron does around the block is untouched.

Scope (checked by the config before any process starts): GPT, --use-dpp with --dpp-policy dpp (a
graph's backward is one piece, so split backward cannot defer its weight GEMMs), TP 1, fixed
sequence length, dropout 0 (a captured dropout would need megatron's graph-safe RNG tracker; with
p = 0 no random numbers are drawn, and the tracker's fork is bypassed while capturing).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class _BlockCall(torch.nn.Module):
    """The callable a slot captures: a chunk's transformer block from its input activation (graphs
    take tensors only). The block reads its input from ``hidden_states`` on the first stage and from
    set_input_tensor on later ones; both are given, so one capture serves either."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        super().__init__()
        # Registered, so make_graphed_callables differentiates w.r.t. exactly the block's parameters:
        # an unused parameter (the embedding, run outside the graph) broke backward capture on the GPU.
        self.decoder = _decoder_of(chunk)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.decoder.set_input_tensor(x)
        return self.decoder(hidden_states=x, attention_mask=attention_mask)


def _decoder_of(chunk: torch.nn.Module) -> torch.nn.Module:
    """The transformer block behind megatron's DDP / Float16Module wrappers."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(chunk, "decoder")


@contextlib.contextmanager
def _block_replayed(decoder: torch.nn.Module, call: torch.nn.Module) -> Iterator[None]:
    """For the duration of one chunk forward, the block's forward is the slot's replay."""

    def replay(hidden_states=None, attention_mask=None, **others):
        # What else GPTModel passes its block (rotary embeddings, packing, inference context) is None
        # in training with this trainer's models; a value the capture did not see would be silently
        # ignored by a replay, so it is an error instead.
        unexpected = sorted(k for k, v in others.items() if v is not None)
        if unexpected:
            raise RuntimeError(f"--dpp-cuda-graphs: the transformer block got {', '.join(unexpected)}, which "
                               "its CUDA graph did not capture")
        x = hidden_states if hidden_states is not None else decoder.input_tensor
        del decoder.forward  # a call that runs Python (not a replay) must reach the real block
        try:
            return call(x, attention_mask)
        finally:
            decoder.forward = replay

    decoder.forward = replay  # an instance attribute: shadows the class's forward for this call only
    try:
        yield
    finally:
        del decoder.forward


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
        self.decoder = _decoder_of(chunk)
        self.calls = []
        with _rng_fork_bypassed():
            for _ in range(slots):
                x = torch.zeros(shapes.activation, dtype=shapes.activation_dtype, device=device,
                                requires_grad=True)
                # Each slot its own module object: make_graphed_callables replaces the module's forward.
                call = capture(_BlockCall(chunk), (x, attention_mask), allow_unused_input=True)
                self.calls.append(call)
        self._free = list(range(slots))[::-1]
        self._taken: dict[int, int] = {}
        self.replayed = self.eager = 0  # forwards of training steps, for the end-of-run log

    def matches(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (tokens on the first stage, the activation elsewhere) has the captured shape."""
        if self.first:
            return tuple(x.shape) == self.shapes.tokens
        return tuple(x.shape) == self.shapes.activation and x.dtype == self.shapes.activation_dtype

    def take(self, microbatch: int, x: torch.Tensor) -> torch.nn.Module | None:
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

    def give_back(self, microbatch: int) -> bool:
        """After the microbatch's backward was queued: whether it held a slot (False: it ran eagerly)."""
        slot = self._taken.pop(microbatch, None)
        if slot is not None:
            self._free.append(slot)
        return slot is not None

    def in_use(self) -> list[int]:
        return sorted(self._taken)


class Replay:
    """What the forward step function receives as ``model`` for a graphed forward: called like the
    megatron chunk, it runs the chunk with the block's forward swapped for the slot's replay.
    ``stands_for`` is that chunk (wrappers of the forward step that tell chunks apart, e.g. stall
    injection, read it)."""

    def __init__(self, graphs: ChunkGraphs, call: torch.nn.Module, stands_for: torch.nn.Module) -> None:
        self.graphs, self.call, self.stands_for = graphs, call, stands_for

    def __call__(self, *args, **kwargs):
        with _block_replayed(self.graphs.decoder, self.call):
            return self.stands_for(*args, **kwargs)


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
    """Graph slots for each chunk of this stage. Runs each block's forward and backward a few times
    with zero inputs (warm-up and capture, no gradient is accumulated): call it before the first step."""
    graphs = {}
    for c, chunk in enumerate(chunks):
        graphs[c] = ChunkGraphs(chunk, shape.is_first_virtual(stage, c), slots, shapes, attention_mask, device)
    torch.cuda.synchronize(device)
    log.info("stage %d: CUDA graphs for chunk(s) %s, %d slot(s) each", stage, sorted(graphs), slots)
    return graphs
