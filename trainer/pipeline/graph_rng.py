"""Random numbers under CUDA graph capture, for the slots of trainer/pipeline/cuda_graphs.py.

Dropout (p > 0): every replay draws fresh masks. megatron's RNG tracker is created graph-safe
(``use_cudagraphable_rng``: each tracker state is a generator object the tracker swaps in, rather than
a state tensor it copies), and each forward graph registers every tracker state besides the default
generator torch registers itself (:func:`register_generators`, as megatron-core's own graphed
layers do; only with dropout > 0, as a registered generator costs two small kernels per replay). A
registered generator hands the capture a device-side seed and offset, and each replay advances the
generator's offset by what the graph draws, so a replay draws what an eager op at that point of the
generator's sequence would: the same distribution, a different mask every replay, and the same run again from the same seed (the
order of forwards on a stage decides the sequence). Not bit-equal to an eager run: a graph consumes
its offsets in whole-graph steps. Recompute with dropout is refused: megatron's checkpoint keeps a
graph-safe state by reference, so the recomputed attention would draw a new mask, not the forward's.

Without dropout nothing random is drawn, but megatron still reads and sets generator states around
attention and recompute, which a capture forbids: :func:`rng_state_bypassed` skips those for warm-up
and capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def register_generators(graph: torch.cuda.CUDAGraph) -> None:
    """Before a capture: register every state of megatron's graph-safe RNG tracker with ``graph``
    (torch registers the default generator by itself at capture start, not the tracker's states, and a
    dropout that draws from an unregistered state inside a capture fails). Each replay then advances
    each generator by what the graph draws: fresh masks every replay. Without a graph-safe tracker
    there is nothing to register (the CPU tests' stand-ins; with graphs on CUDA trainer.train always
    seeds the graph-safe one)."""
    from megatron.core.tensor_parallel import random as tp_random

    tracker = tp_random.get_cuda_rng_tracker()
    if not tp_random.is_graph_safe_cuda_rng_tracker(tracker):
        return
    for state in tp_random.get_all_rng_states().values():
        graph.register_generator_state(state)


def graph_safe_rng() -> bool:
    """Whether megatron's RNG tracker is the graph-safe one (trainer.train seeds it so with graphs)."""
    from megatron.core.tensor_parallel import random as tp_random

    return tp_random.is_graph_safe_cuda_rng_tracker(tp_random.get_cuda_rng_tracker())


def capture(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream, draws: bool = False):
    """One capture in thread-local capture mode (trainer/pipeline/cuda_graphs.py's docstring says why,
    under tensor parallelism); ``draws``: the captured code draws random numbers (dropout), so the
    tracker's generators are registered first. Only then: a registered generator costs two small kernels per replay (its seed
    and offset written for the graph), whether or not the graph draws from it."""
    if draws:
        register_generators(graph)
    return torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")


def draws_random(call: torch.nn.Module) -> bool:
    """Whether the block's forward draws random numbers: dropout > 0 in its TransformerConfig, or
    Transformer Engine's attention, whose fused (cuDNN) kernel advances the philox offset of the
    tracker state it runs under even at dropout 0 (unregistered, its capture fails with "Attempt to
    increase offset for a CUDA generator not in capture mode"). (The backward never draws: recompute with
    dropout is refused, and a dropout's backward reuses its mask.)"""
    decoder = call.decoder
    config = getattr(decoder, "config", None)
    if config is not None and (config.hidden_dropout > 0 or config.attention_dropout > 0):
        return True
    return isinstance(decoder, torch.nn.Module) and any(_is_te_attention(m) for m in decoder.modules())


def _is_te_attention(module: torch.nn.Module) -> bool:
    """A Transformer Engine DotProductAttention (megatron-core's TEDotProductAttention subclasses it);
    found by the class's module, so that a run without TE never imports it."""
    return any(c.__module__.startswith("transformer_engine.") and c.__name__ == "DotProductAttention"
               for c in type(module).__mro__)


@contextlib.contextmanager
def rng_state_bypassed() -> Iterator[None]:
    """megatron saves and restores the CUDA generator's state around attention dropout (its RNG
    tracker's fork) and around a recomputed block (selective recompute's checkpoint saves every RNG
    state in the forward and restores it for the recompute in the backward). Reading or setting a
    generator's state is not allowed while a graph is being captured. Without the graph-safe tracker
    dropout is 0 (the config's rule) and nothing random is drawn in between, so for warm-up and capture
    the fork is skipped and the checkpoint's save/restore is a no-op (replays never run Python). With
    the graph-safe tracker (trainer.train seeds it so with graphs) nothing is bypassed."""
    from megatron.core.tensor_parallel import random as tp_random

    if graph_safe_rng():  # its fork and save/restore swap generator objects: legal while capturing
        yield
        return
    saved = (tp_random.CudaRNGStatesTracker.fork, tp_random._get_all_rng_states, tp_random._set_all_rng_states)
    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    tp_random._get_all_rng_states = lambda: (None, None, None)
    tp_random._set_all_rng_states = lambda *states: None
    try:
        yield
    finally:
        (tp_random.CudaRNGStatesTracker.fork, tp_random._get_all_rng_states,
         tp_random._set_all_rng_states) = saved
