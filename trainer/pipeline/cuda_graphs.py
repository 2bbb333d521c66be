"""``--dpp-cuda-graphs``: replay each chunk's transformer block, forward and backward, from CUDA graphs.

Why: on the benchmark model gpt16-h2048 (GPT h2048, mbs 2, megatron-core's local layer spec, no Transformer
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

Variable lengths (--variable-seq-lengths): every slot holds one graph pair per bucket length, all in
the slot's own memory pool (:func:`capture_slot` says why that costs one length's activations, not
the sum); a microbatch replays its length's pair.

Split backward (--dpp-policy dpp-zb): a slot holds three graphs per length -- the forward, I (the
backward with the linears' weight GEMMs deferred) and W (those GEMMs, accumulated into
``main_grad``). F takes the slot and W gives it back, so a microbatch whose W waits keeps its
activations in the slot exactly as eager dpp-zb keeps them in the store; what W reads besides the
activations (what the backward allocated for W) is copied into one of the buffer sets the stage's slots
share only when another backward graph of the stage replays before this W, by the slot's evacuation
graph for that set (a W graph per set reads it); a W that follows its I first reads them in place, from
a graph of its own (trainer/pipeline/graph_operands.py).

Scope (checked by the config before any process starts): GPT or BERT, --use-dpp with --dpp-policy
dpp, dpp-zb or a static order, and with TP > 1 an NCCL tensor-parallel group.

Static orders (--dpp-policy 1f1b, interleaved, zb-h1 under --use-dpp): the same slots, captured as
many per chunk as the order itself holds at most (trainer.schedule.static.peak_held_per_chunk; ZB-H1
holds p on every stage where 1F1B holds p - s), so every forward of the order replays: the fair bar
for the dynamic policies -- same kernels, same launches, only the order differs.

Tensor parallelism (TP > 1, with or without --sequence-parallel): the block's TP collectives
(all-reduce; all-gather and reduce-scatter under sequence parallelism) are captured into its graphs as
NCCL kernels, the way megatron-core's and Transformer Engine's graphed layers capture them. Three
things keep capture and replay from deadlocking or pairing collectives wrongly across a TP group:
every communicator has run the same collectives eagerly before any capture (the warm-up: NCCL
communicators initialise lazily, which a capture forbids); every TP rank captures the same graphs in
the same order (slots, lengths and chunks are iterated identically, so any collective NCCL runs while
registering a captured buffer pairs up); and every TP rank replays the same graph of the same slot in
the same order, because the runtime makes the TP peers run the leader's actions in the leader's order
(trainer/pipeline/tp_decision.py) and a slot is picked by :meth:`ChunkGraphs.take` from nothing but
that order. Captures run with ``capture_error_mode="thread_local"``: the NCCL process group's
watchdog thread (and the transport's threads) keep querying CUDA while this thread captures, which the
default global mode would turn into a capture error. Under sequence parallelism the block's input and
output are the rank's shard of the sequence ([s / TP, b, h]); the attention masks stay full length.
A TP group on gloo cannot be captured (its collectives run on the host), so the config asks for NCCL.

Dropout (p > 0): every replay draws fresh masks (trainer/pipeline/graph_rng.py says how).

BERT: its block is ``encoder``, not ``decoder``, and its attention mask ([b, 1, s, s], from each
microbatch's padding) changes between microbatches, so a BERT slot owns a mask buffer per length that
each replay fills (``GraphShapes.mask_varies``); GPT's causal mask is the same tensor every time and
is captured as a constant.

Selective recompute (--recompute-activations / --recompute-granularity selective) works inside the
graphs: the forward graph keeps only the core attention's inputs, and the backward graph recomputes
the attention into the stage's shared backward pool. That is how a slot gets cheaper: on the benchmark
model the attention probabilities (fp32 softmax output and its bf16 copy, [b, heads, s, s] per layer)
are most of a layer's saved activations, so more slots fit in the memory megatron's 1F1B uses.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from trainer.pipeline.graph_operands import (
    BackwardPoolState,
    EvacuationSets,
    OperandPlan,
    StaticOperandStore,
    check_kept,
    copies_wait,
    live_memory,
    plan_operands,
)
from trainer.pipeline.graph_rng import capture, draws_random, rng_state_bypassed
from trainer.pipeline.split_backward import SplitBackward, WeightGradStore

log = logging.getLogger(__name__)

_CAPTURED: weakref.WeakSet = weakref.WeakSet()
"""Every graph this module captured and has not freed yet (weakly: a graph nothing holds is freed by
its destructor anyway). :func:`free_captured_graphs` frees what is left of them at tear-down."""


def _destroy_graph(graph) -> None:
    """Destroy a graph's executable now (``CUDAGraph.reset``), whoever still holds the Python object:
    an NCCL collective captured in it keeps its communicator's ``ncclCommDestroy`` waiting until the
    executable is destroyed (see :meth:`ChunkGraphs.release`)."""
    graph.reset()
    _CAPTURED.discard(graph)


def _destroy_slots(slots: list) -> int:
    """Destroy every graph of these slots (see :meth:`ChunkGraphs.release`); how many."""
    freed = 0
    for slot in slots:
        for replay in (slot.values() if isinstance(slot, dict) else [slot]):
            for graph in (replay.graphs() if hasattr(replay, "graphs") else []):
                _destroy_graph(graph)
                freed += 1
    return freed


def free_captured_graphs() -> int:
    """Free every graph of this module not freed yet (a capture that failed half-way, a slot that no
    :class:`ChunkGraphs` holds any more but something else does); how many. Tear-down calls it after
    each chunk's :meth:`ChunkGraphs.release`, so nothing captured outlives the process groups."""
    left = list(_CAPTURED)
    for graph in left:
        _destroy_graph(graph)
    return len(left)


def _capture(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream, draws: bool = False):
    """graph_rng.capture, with ``graph`` remembered so that tear-down frees it whatever holds it."""
    _CAPTURED.add(graph)
    return capture(graph, pool, stream, draws=draws)


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
    """The transformer block behind megatron's DDP / Float16Module wrappers: GPTModel's ``decoder``,
    BertModel's ``encoder``."""
    from megatron.core.utils import get_attr_wrapped_model

    try:
        return get_attr_wrapped_model(chunk, "decoder")
    except RuntimeError:
        return get_attr_wrapped_model(chunk, "encoder")


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


def _attention_modules(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """megatron-core's attention modules of a block: they read ``checkpoint_core_attention`` on every
    forward (set from the config at construction), so a capture can choose recompute per slot."""
    return [m for m in decoder.modules() if hasattr(m, "checkpoint_core_attention")]


@contextlib.contextmanager
def _core_attention_recompute(decoder: torch.nn.Module, recompute: bool) -> Iterator[None]:
    """For one warm-up or capture: the block's attention recomputes its core (or not), then the
    configured value is back (eager ops of the run follow the configuration)."""
    modules = _attention_modules(decoder)
    saved = [m.checkpoint_core_attention for m in modules]
    for m in modules:
        m.checkpoint_core_attention = recompute
    try:
        yield
    finally:
        for m, value in zip(modules, saved, strict=True):
            m.checkpoint_core_attention = value


@dataclass(frozen=True)
class GraphShapes:
    """What a slot is captured for: the chunk input's largest shape and dtype, the microbatch's [b, s]
    at that length, and every sequence length a microbatch may have (one, unless the lengths vary)."""

    activation: tuple[int, ...]  # [s / shards, b, h] of the block's input at the longest length
    activation_dtype: torch.dtype
    tokens: tuple[int, int]  # [b, s] at the longest length
    lengths: tuple[int, ...] = ()
    """Captured sequence lengths (--variable-seq-lengths: every bucket length); () = only s."""
    sequence_shards: int = 1
    """--sequence-parallel: the TP size (the block's input holds 1/shards of the sequence); else 1."""
    mask_varies: bool = False
    """The attention mask differs between microbatches (BERT's padding): each slot owns a mask buffer
    per length that a replay fills. False (GPT): the captured mask is the one every microbatch passes."""

    def captured_lengths(self) -> tuple[int, ...]:
        """Full sequence lengths, longest first."""
        return tuple(sorted(set(self.lengths or (self.activation[0] * self.sequence_shards,)), reverse=True))

    def rows(self, length: int) -> int:
        """The block input's first dimension at a sequence length (this rank's shard of it)."""
        return length // self.sequence_shards


@dataclass
class _GraphPair:
    """One slot's forward and backward graph at one sequence length, and the static tensors they read
    and write: the input ``x`` and output gradient ``grad_out`` (views of the slot's buffers, sized
    for the longest length), the output ``out`` and the input gradient ``grad_x``."""

    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph
    x: torch.Tensor
    out: torch.Tensor
    grad_out: torch.Tensor
    grad_x: torch.Tensor
    wgt: torch.cuda.CUDAGraph | None = None
    """Split backward: the weight GEMMs ``bwd`` (then I) deferred; None = ``bwd`` is the whole backward."""
    w_buffers: list[torch.Tensor] | None = None
    """Split backward: the slot's operand buffers that ``bwd`` writes and ``wgt`` reads, held here: ordinary
    allocations, which the caching allocator would hand to other tensors once unreferenced."""
    mask: torch.Tensor | None = None
    """The slot's attention-mask buffer at this length when masks vary (BERT), which each replay fills;
    None: the captured mask is every microbatch's."""
    evacs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    """Split backward with operands the backward leaves in the pool: per evacuation set this slot may use
    (its id in ``pool``), the graph copying them there; empty: ``bwd`` leaves nothing W reads in the pool
    (or copies it into ``w_buffers`` itself, which ``wgt`` reads)."""
    wgts: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    """With ``evacs``: per set, the W graph reading the operands there (``wgt`` is then unused: None)."""
    wgt_direct: torch.cuda.CUDAGraph | None = None
    """With ``evacs``: the W graph that reads those operands in the pool, right after ``bwd`` (no other
    backward graph of the stage replayed in between; ``pool`` decides)."""
    pool: BackwardPoolState | None = None
    """The stage's backward-pool state: which slot's operands lie in the pool, which set holds whose."""


class _PairReplay:
    """A slot's replay at one length, called like the block: ``replay(x, attention_mask)``; with a
    split backward, :meth:`replay_weights` is its W."""

    def __init__(self, pair: _GraphPair) -> None:
        self.pair = pair

    def graphs(self) -> list:
        """The pair's captured graphs: forward, backward, and with a split backward W (and the evacuation
        and the direct W where the backward allocates what W reads)."""
        pair = self.pair
        return [g for g in (pair.fwd, pair.bwd, pair.wgt, pair.wgt_direct, *pair.evacs.values(), *pair.wgts.values())
                if g is not None]

    def __call__(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # GPT: the mask was captured with the pair (the causal mask of the pair's length, the tensor every
        # microbatch passes). BERT: this microbatch's padding mask goes into the slot's mask buffer.
        buffer = self.pair.mask
        if buffer is not None and attention_mask is not None and attention_mask.data_ptr() != buffer.data_ptr():
            if attention_mask.shape != buffer.shape:
                raise RuntimeError(f"--dpp-cuda-graphs: an attention mask of shape {tuple(attention_mask.shape)}, "
                                   f"captured {tuple(buffer.shape)}")
            buffer.copy_(attention_mask)
        return _Replayed.apply(x, self.pair)

    def replay_weights(self) -> None:
        pair = self.pair
        if pair.evacs:
            pair.pool.replay_w(pair)
            return
        if pair.wgt is None:
            raise RuntimeError("this CUDA graph slot was captured without a split backward: it has no W graph")
        if pair.pool is not None:
            pair.pool.before_backward(pair)
        pair.wgt.replay()


class _Replayed(torch.autograd.Function):
    """A captured block as one autograd node: forward replays the forward graph, backward the backward
    graph. The block's parameters are not inputs of this node: their gradients were accumulated into
    ``main_grad`` inside the backward graph (see :func:`capture_slot`), so autograd never sees them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pair: _GraphPair) -> torch.Tensor:
        if x.data_ptr() != pair.x.data_ptr():
            pair.x.copy_(x)
        pair.fwd.replay()
        ctx.pair = pair
        return pair.out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pair = ctx.pair
        if grad.data_ptr() != pair.grad_out.data_ptr():
            pair.grad_out.copy_(grad)
        if pair.pool is not None:
            pair.pool.before_backward(pair)
        pair.bwd.replay()
        if pair.pool is not None:
            pair.pool.after_i(pair)
        return pair.grad_x.detach(), None


def _check_grads_went_to_main_grad(params: list, captured: str) -> None:
    """After a backward or W capture every weight gradient must have gone to ``main_grad`` (megatron
    DDP's hook, inside the capture): one left in ``.grad`` is a tensor of the capture, which a replay
    would overwrite instead of accumulating anywhere."""
    leftover = sum(1 for p in params if p.grad is not None)
    if leftover:
        raise RuntimeError(f"--dpp-cuda-graphs: {captured} left {leftover} weight gradient(s) in .grad instead of "
                           "accumulating them into main_grad (is the chunk wrapped in megatron's DDP?)")


def capture_slot(call: _BlockCall, shapes: GraphShapes, masks: dict, device: torch.device,
                 backward_pool=None, split: SplitBackward | None = None,
                 operands: OperandPlan | None = None, pool_state: BackwardPoolState | None = None,
                 operand_copies: str = "auto", evacuation_sets: EvacuationSets | None = None) -> dict:
    """One slot's graph pairs, one per captured length, as ``{length: callable(x, attention_mask)}``.

    Memory, forward: all of a slot's forward graphs share one private pool, captured longest first.
    That is safe because a slot serves one microbatch at a time -- its forward replay, then its
    backward replay, then the next microbatch's (of any length) -- so a pair only needs its memory
    from its forward replay to its backward replay; what a pair's capture freed (its activations, once
    the backward was captured) the next length's capture reuses. A slot costs about its longest
    length's activations, not the sum.

    Memory, backward: every backward graph of the stage (all slots, lengths and chunks) is captured
    into ``backward_pool``, one pool shared by all. Backward replays run one after another on the
    stage's stream and nothing a backward allocates outlives its replay except the input gradient
    (kept allocated, so never shared), so one backward workspace serves them all -- as in eager mode,
    where only the in-flight activations are held per microbatch. With a pool per slot instead, every
    slot kept a full backward workspace (measured on 4xH100: ~2.1 GiB per slot of a 5-layer h2048 stage).

    Gradients: the backward is captured as ``out.backward(grad)``, so autograd's leaf accumulation and
    megatron DDP's per-parameter hook (``main_grad += grad; grad = None``) run *inside* the capture and
    are replayed with it: each weight gradient is added to ``main_grad`` and its memory reused at once,
    instead of every slot keeping a full set of static weight gradients for autograd to accumulate
    later. (--overlap-grad-reduce, whose hook also launches communication, is refused with graphs.)

    Split backward (``split``, with ``operands``: the warm-up's plan of which deferred operands the
    backward allocates, at the longest length): the backward is captured with the linears' weight GEMMs
    deferred into a :class:`StaticOperandStore` (I), then that store's replay as a third graph (W), into
    the shared backward pool (nothing it allocates outlives it). With ``pool_state`` (the stage's
    :class:`BackwardPoolState`) I leaves those operands in the pool, and more graphs are captured: the
    direct W (reading them in the pool) and, per evacuation set the slot may use, the evacuation (their
    copies into the set) and the W reading the set; the state picks per replay. The sets are
    ``evacuation_sets``, shared by the stage's slots, or without them one set of this slot's own
    (--dpp-graph-evacuation-sets slots). Without ``pool_state``, or where ``operand_copies``
    (--dpp-graph-operand-copies) says so for this plan (:func:`copies_wait`), I copies them into the
    slot's own buffers, and W reads the copies."""
    if (split is None) != (operands is None):
        raise ValueError("capture_slot: a split backward needs both the controller and the warm-up's operands")
    x_buf = torch.zeros(shapes.activation, dtype=shapes.activation_dtype, device=device)
    deferred = split is not None and pool_state is not None and copies_wait(operands, operand_copies)
    # Where W's operands are copied to (the longest length's buffers, trainer/pipeline/graph_operands.py): the
    # stage's shared evacuation sets, or one set of the slot's own.
    sets: dict[int, list[torch.Tensor]] = {}
    grad_buffers = None
    if deferred and evacuation_sets is not None:
        sets = {k: evacuation_sets.views(i, operands) for i, k in enumerate(pool_state.shared)}
    elif operands is not None:
        grad_buffers = operands.allocate(device)
        if deferred:
            sets = {pool_state.own(): grad_buffers}
    grad_buf = torch.zeros_like(x_buf)
    params = [p for p in call.parameters() if p.requires_grad]
    pool = torch.cuda.graph_pool_handle()
    backward_pool = backward_pool if backward_pool is not None else pool
    stream = torch.cuda.current_stream(device)
    replays = {}
    for length in shapes.captured_lengths():
        x = x_buf[:shapes.rows(length)].detach().requires_grad_()
        grad_out = grad_buf[:shapes.rows(length)]
        mask = masks[length].clone() if shapes.mask_varies else masks[length]
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with _capture(fwd, pool, stream, draws=draws_random(call)):
            out = call(x, mask)
        # Leaves' .grad must start empty, so autograd hands each new gradient to the hook (no copy).
        stale = [p for p in params if p.grad is not None]
        if stale or x.grad is not None:
            raise RuntimeError(f"--dpp-cuda-graphs: {len(stale)} parameter(s) hold a .grad before capture")
        store = (StaticOperandStore([] if deferred else grad_buffers, operands.copies, deferred)
                 if split is not None else None)
        live = live_memory(device) if split is not None else None  # before I: what it may leave where it is
        with (split.capture_into(store, f"CUDA graph capture at length {length}") if split is not None
              else contextlib.nullcontext()):
            with _capture(bwd, backward_pool, stream):
                out.backward(grad_out)
        _check_grads_went_to_main_grad(params, f"the backward graph at length {length}")
        wgt = wgt_direct = None
        evacs: dict[int, torch.cuda.CUDAGraph] = {}
        wgts: dict[int, torch.cuda.CUDAGraph] = {}
        if store is not None:
            check_kept(store, live, length)
            if deferred:
                # While the store still holds the operands in the pool: the copies into each set, the W
                # reading them in the pool, then the W reading each set.
                for k, buffers in sets.items():
                    evacs[k] = torch.cuda.CUDAGraph()
                    with _capture(evacs[k], backward_pool, stream):
                        store.copy_out_to(buffers)
                wgt_direct = torch.cuda.CUDAGraph()
                with _capture(wgt_direct, backward_pool, stream):
                    store.replay()  # drops the entries reading the pool
                _check_grads_went_to_main_grad(params, f"the direct W graph at length {length}")
                for k, buffers in sets.items():
                    wgts[k] = torch.cuda.CUDAGraph()
                    with _capture(wgts[k], backward_pool, stream):
                        WeightGradStore(store.reading(buffers)).replay()
                    _check_grads_went_to_main_grad(params, f"the W graph reading evacuation set {k} at length {length}")
                store.release()  # the pool's operands and the forward's inputs it still names
            else:
                wgt = torch.cuda.CUDAGraph()
                with _capture(wgt, backward_pool, stream):
                    store.replay()  # drops the entries: the linears' inputs return to the slot's forward pool
                _check_grads_went_to_main_grad(params, f"the W graph at length {length}")
        pair = _GraphPair(fwd, bwd, x, out.detach(), grad_out, x.grad, wgt, grad_buffers,
                          mask if shapes.mask_varies else None, evacs, wgts, wgt_direct, pool_state)
        x.grad = None
        del out
        replays[length] = _PairReplay(pair)
    return replays


def _warm_up(call: _BlockCall, shapes: GraphShapes, masks: dict, device: torch.device, iters: int = 2,
             split: SplitBackward | None = None) -> OperandPlan | None:
    """Each length's forward and backward run eagerly first (cuBLAS handles and workspaces, autotuned
    kernels: nothing may initialise lazily inside a capture). A full ``backward``, as the capture
    runs it (selective recompute's checkpoint refuses ``torch.autograd.grad``); what it adds to the
    parameters' ``main_grad`` is zeroed again here (every step zeroes the grad buffers anyway).

    With a split backward, each length's last pass defers its weight GEMMs into a store and replays it
    (I and W as the graphs run them); returned: the longest length's plan of the operands to copy."""
    params = [p for p in call.parameters() if p.requires_grad]
    sized = None
    for length in shapes.captured_lengths():
        for i in range(iters):
            x = torch.zeros((shapes.rows(length), *shapes.activation[1:]), dtype=shapes.activation_dtype,
                            device=device, requires_grad=True)
            out = call(x, masks[length])
            if split is None or i < iters - 1:
                out.backward(torch.ones_like(out))
                continue
            # The plan comes from the longest length (first), its backward retaining the graph: no forward
            # block is freed meanwhile, so none can pass a tensor that backward allocates for alive before it.
            planning = sized is None
            grad, live = torch.ones_like(out), live_memory(device) if planning else None
            with split.capture_into(WeightGradStore(), f"CUDA graph warm-up at length {length}") as store:
                out.backward(grad, retain_graph=planning)
            sized = plan_operands(store.entries, live) if planning else sized
            store.replay()
            del out, grad
    for p in params:
        p.grad = None
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()
    return sized


def release_cached_blocks(device: torch.device) -> None:
    """Hand the ordinary pool's cached, unallocated blocks back to the device, once its queued kernels ran.

    Why after each chunk's warm-up, before its slots capture: the warm-up's eager blocks (about one
    slot's activations and a backward workspace) stay cached in the ordinary pool, which no capture
    allocates from; kept, they sat under every slot captured after them, and the run's peak reserved
    memory was reached during set-up (graphs + warm-up). ``empty_cache`` frees only blocks no tensor
    holds, never a live graph's private pool: nothing a graph uses is released."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def recompute_modes(slots: int, recompute_slots: int) -> list[bool | None]:
    """Per slot: recomputes its core attention (True) or keeps it (False); None = as configured."""
    return [i >= slots - recompute_slots for i in range(slots)] if recompute_slots else [None] * slots


def warm_up_chunk(chunk: torch.nn.Module, recomputes: list[bool | None], shapes: GraphShapes, masks: dict,
                  device: torch.device, split: SplitBackward | None = None) -> OperandPlan | None:
    """:func:`_warm_up` of a chunk in each attention mode its slots are captured in (both code paths warm,
    if both are captured); the split backward's operand plan, or None."""
    operands, decoder = None, _decoder_of(chunk)
    with rng_state_bypassed():
        for mode in sorted(set(recomputes), key=str):
            with (contextlib.nullcontext() if mode is None else _core_attention_recompute(decoder, mode)):
                operands = _warm_up(_BlockCall(chunk), shapes, masks, device, split=split) or operands
    return operands


class ChunkGraphs:
    """The graph slots of one model chunk."""

    def __init__(self, chunk: torch.nn.Module, first: bool, slots: int, shapes: GraphShapes,
                 masks: dict, device: torch.device, capture=None, backward_pool=None,
                 recompute_slots: int = 0, split: SplitBackward | None = None,
                 pool_state: BackwardPoolState | None = None, operand_copies: str = "auto",
                 warmed: tuple[OperandPlan | None] | None = None,
                 evacuation_sets: EvacuationSets | None = None) -> None:
        """``masks``: the attention mask of each captured length. ``capture``: :func:`capture_slot`
        unless given (the CPU tests pass one that returns the block uncaptured, to check everything
        around the graphs without a GPU). ``backward_pool``: the stage's shared backward pool (see
        :func:`capture_slot`). ``recompute_slots``: how many slots (the last ones) are captured with
        the core attention recomputed in the backward (--dpp-recompute-slots); the others keep their
        activations, whatever the configuration says. ``split``: the rank's split-backward controller
        (--dpp-policy dpp-zb): each slot is captured as F, I and W graphs and is given back by
        :meth:`replay_weights` instead of :meth:`give_back`. ``pool_state``: the stage's backward-pool state
        (every chunk of the stage shares it, as it shares the pool): with it, a slot copies W's operands out
        of the pool only when another backward replays first (:func:`capture_slot`), as ``operand_copies``
        (--dpp-graph-operand-copies) allows, into ``evacuation_sets`` (the stage's shared sets; None: a set
        per slot). ``warmed``: (the plan,) of :func:`warm_up_chunk` already run for this chunk (the stage
        sizes its shared sets from every chunk's plan before any capture); None: warmed up here."""
        if slots < 1:
            raise ValueError(f"need at least one graph slot, got {slots}")
        if not 0 <= recompute_slots <= slots:
            raise ValueError(f"--dpp-recompute-slots: {recompute_slots} recomputing slot(s) of {slots}")
        self.first, self.shapes, self.pool_state = first, shapes, pool_state
        self.lengths = shapes.captured_lengths()
        missing = sorted(set(self.lengths) - set(masks))
        if missing:
            raise ValueError(f"no attention mask for captured length(s) {missing}")
        self.decoder = _decoder_of(chunk)
        # Per slot: recomputes its core attention (True) or keeps it (False); None = as configured.
        self.recomputes: list[bool | None] = recompute_modes(slots, recompute_slots)
        with rng_state_bypassed():
            if capture is None:
                operands = (warmed if warmed is not None else
                            (warm_up_chunk(chunk, self.recomputes, shapes, masks, device, split),))[0]
                release_cached_blocks(device)  # before the captures: see the function
                capture = functools.partial(capture_slot, backward_pool=backward_pool, split=split,
                                            operands=operands, pool_state=pool_state,
                                            operand_copies=operand_copies, evacuation_sets=evacuation_sets)
            self.slots: list = []
            self.slot_bytes: list[int] = []  # what each slot's capture added to the reserved memory
            self._capture_slot = functools.partial(capture, shapes=shapes, masks=masks, device=device)
            self._chunk, self._device = chunk, device
            for mode in self.recomputes:
                self._capture_one(mode)
        self._free = list(range(slots))[::-1]
        self._taken: dict[int, tuple[int, int]] = {}  # microbatch -> (slot, captured length)
        self.replayed = self.eager = 0  # forwards of training steps, for the end-of-run log

    def _capture_one(self, mode: bool | None) -> None:
        cuda = self._device.type == "cuda"
        before = torch.cuda.memory_reserved(self._device) if cuda else 0
        with self._recompute(mode):  # each slot its own module object: the block's forward is swapped per call
            self.slots.append(self._capture_slot(_BlockCall(self._chunk)))
        self.slot_bytes.append(torch.cuda.memory_reserved(self._device) - before if cuda else 0)

    def resize(self, slots: int) -> None:
        """Capture more slots (keeping their activations) or destroy the last ones, before the first step
        (--dpp-held-cap fit: trainer/pipeline/stage_graphs.py)."""
        if self._taken:
            raise RuntimeError("graph slots are resized before the first step, while none is taken")
        with rng_state_bypassed():
            while len(self.slots) < slots:
                self.recomputes.append(False if any(r is not None for r in self.recomputes) else None)
                self._capture_one(self.recomputes[-1])
        if len(self.slots) > slots:
            _destroy_slots(self.slots[slots:])
            del self.slots[slots:], self.recomputes[slots:], self.slot_bytes[slots:]
        self._free = list(range(len(self.slots)))[::-1]

    def release(self) -> int:
        """Free every captured graph of this chunk now; how many (0 for slots a stand-in capture made).

        Why, and why before the process groups go: a graph that captured an NCCL collective (TP > 1)
        holds a reference on its communicator (NCCL attaches a CUDA user object to the graph), and
        ``ncclCommDestroy`` -- so torch's ``destroy_process_group`` -- polls until every such graph is
        destroyed: for ever while one lives (NCCL >= 2.26; pytorch/pytorch#115388). Dropping the
        Python references is not enough: an autograd node of the last step, a ``Replay`` or a cycle
        waiting for the garbage collector can still hold a graph. ``CUDAGraph.reset`` destroys the
        executable whoever holds the object. The caller has synchronised the device first (a graph
        whose replay still runs is only released once it finishes)."""
        freed = _destroy_slots(self.slots)
        self.slots = []
        self._free, self._taken = [], {}
        return freed

    def length_of(self, x: torch.Tensor) -> int | None:
        """The captured length ``x`` (tokens on the first stage, the activation elsewhere) has, or None."""
        if self.first:
            ok = x.dim() == 2 and x.shape[0] == self.shapes.tokens[0]
            length = x.shape[1] if ok else None
        else:
            ok = tuple(x.shape[1:]) == self.shapes.activation[1:] and x.dtype == self.shapes.activation_dtype
            length = x.shape[0] * self.shapes.sequence_shards if ok else None
        return length if length in self.lengths else None

    def take(self, microbatch: int, x: torch.Tensor):
        """A free slot's replay for this microbatch's forward (called as ``replay(x, attention_mask)``);
        None = run it eagerly."""
        if not torch.is_grad_enabled():
            return None
        length = self.length_of(x)
        if not self._free or length is None:
            self.eager += 1
            return None
        self.replayed += 1
        # A slot that keeps its activations when one is free (a recomputing one costs GPU time).
        keeping = [i for i, slot in enumerate(self._free) if not self.recomputes[slot]]
        slot = self._free.pop(keeping[-1] if keeping else -1)
        self._taken[microbatch] = (slot, length)
        return self.slots[slot][length]

    def holds(self, microbatch: int) -> bool:
        """Whether the microbatch's forward took a slot (its backward replays; False: it ran eagerly)."""
        return microbatch in self._taken

    def _recompute(self, mode: bool | None):
        return contextlib.nullcontext() if mode is None else _core_attention_recompute(self.decoder, mode)

    def give_back(self, microbatch: int) -> bool:
        """After the microbatch's whole backward was queued (B; with a split backward: its W, see
        :meth:`replay_weights`): whether it held a slot (False: it ran eagerly)."""
        taken = self._taken.pop(microbatch, None)
        if taken is not None:
            self._free.append(taken[0])
        return taken is not None

    def replay_weights(self, microbatch: int) -> bool:
        """W of a split backward: queue the slot's W graph (its deferred weight GEMMs) and give the slot
        back; False if the microbatch ran eagerly (its GEMMs are in the runtime's store). A slot made
        by a stand-in capture without a W graph (the CPU tests': its linears ran eagerly and deferred
        into the runtime's store as well) has nothing to replay."""
        taken = self._taken.get(microbatch)
        if taken is None:
            return False
        replay = self.slots[taken[0]][taken[1]]
        if hasattr(replay, "replay_weights"):
            replay.replay_weights()
        return self.give_back(microbatch)

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
