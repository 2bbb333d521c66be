"""Which operands of a slot's deferred weight GEMMs its I graph must copy into buffers of its own.

A split backward under CUDA graphs (trainer/pipeline/cuda_graphs.py) captures each slot's backward as
I (input gradients, the weight GEMMs deferred into a store) and W (those GEMMs). Every backward graph
of a stage -- all slots, lengths and chunks -- is captured into one shared backward pool, so a tensor
the I graph allocates is overwritten by the next backward replay of any slot, before this slot's W
reads it. A deferred GEMM's operands are therefore of two kinds:

- alive before the backward began: the forward's saved activations (in the slot's own forward pool,
  untouched until the slot's next forward, which comes after its W), the slot's static buffers,
  parameters. W may read them where they are;
- allocated by the backward: every output gradient, and an input the backward itself made -- the
  TP-gathered input of Transformer Engine's column-parallel linears under sequence parallelism (TE
  gathers it in the backward, where megatron-core's local linears keep the forward's gather). These
  must be copied before another backward replays: inside the captured I into buffers the slot owns
  (``--dpp-graph-operand-copies in-i``), or, by default, only when needed (below).

Which is which is not assumed per layer type: the eager warm-up finds it by asking the CUDA caching
allocator which blocks were allocated before the backward started (:func:`live_memory`), and
:func:`plan_operands` turns that into the slot's buffer plan (longest length first; a shorter length
uses the leading rows). The warm-up's backward retains its graph, so no forward tensor is freed during
it and no backward tensor can take over a forward tensor's block and pass for one. After each I
capture :func:`check_kept` asks again: in a capture the answer is exact (what the captured backward
allocates comes from the backward pool, never from a block freed elsewhere), and an operand the plan
keeps that the capture allocated fails the capture, naming the GEMM, instead of training on gradients
read from overwritten memory.

The copies cost one output gradient per linear per slot (on the benchmark model gpt16-h2048 ~75 MB per
layer), plus, with TE's layers under sequence parallelism, the gathered input of each column-parallel
linear. Measured on 2xH200 (Transformer Engine's layers, PP=2) that was 8 ms per iteration of a 470 ms
stage: 28 copies per microbatch. Yet most of them are needless: a dynamic zero-bubble order mostly runs
a microbatch's W before the stage's next backward (its next I or B, or another slot's W), and until then
nothing overwrites the backward pool -- forward graphs replay into their slots' own pools, eager ops
allocate from the ordinary one. So the copies are not made inside I but captured as a graph of their
own (the slot's *evacuation*), which :class:`BackwardPoolState` replays only when another backward graph
is about to run while a W still reads the pool; each slot has two W graphs, one reading the operands in
the pool (the W that directly follows its I) and one reading the slot's buffers (after an evacuation).
Measured on 2xH200 (gpt16-h2048, local layers, PP=2, v=1): every one of the split stage's 320 W's read
its operands in place, and that stage's GPU busy time fell to the graphed 1F1B order's; with Transformer
Engine's layers likewise (its 32 W's of a test run, and 9 ms per iteration off the benchmark's step).
``--dpp-graph-operand-copies in-i`` restores the copies inside every I, for measurements
(:func:`copies_wait`).

Where an evacuation copies to: a few buffer sets the stage's slots share (:class:`EvacuationSets`), not a
set per slot. A set per slot is what the copies inside I need, and it was the whole memory a graphed split
backward adds: 1.82 GiB of stage 0's 17.42 GiB at two chunks per stage on gpt16-h2048 (PP=4, 8+4 slots,
2 and 2.5 layers a chunk), 1.117x the graphed interleaved order's peak. Lazily, a set holds a slot's
operands only from its evacuation to its W, and few are held at once. So each slot captures an
evacuation and a W per set, and :class:`BackwardPoolState` evacuates into a free one; when every set is
taken, the slot holding the pool runs its W at once instead (the direct W, read in place, before the
backward that would overwrite it), and the W the schedule runs for it later has nothing left to do. That
is the only change of order, and it is only ever earlier: gradients are equal. How many sets
(``--dpp-graph-evacuation-sets``, default the pipeline size at two or more chunks per stage, two at one)
comes from the host-time model with this pool priced (trainer/schedule/backward_pool.py,
docs/schedules.md): on the benchmark's costs p sets ran within -1.0 .. +0.2% of a set per slot (PP=2 and 4,
one and two chunks, uniform, stalls, lengths, jitter), while two at PP=4, v=2 cost up to +1.6%; at one
chunk every count from two up ran within 0.1%. Measured at v=2: 1.054x the graphed interleaved order's peak
reserved at PP=2 (2xH200) and 1.051x at PP=4 (per process, one H200), where a set per slot gave 1.124x and
1.127x, at the same speed (PP=2).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.pipeline.split_backward import WeightGradStore, _Deferred
from trainer.pipeline.split_backward_te import TeDeferred
from trainer.schedule.backward_pool import DIRECT, EARLY, Move, PoolState

Live = Callable[[torch.Tensor], bool]
"""Whether a tensor's memory was allocated before the backward began (:func:`live_memory`)."""


def deferred_operands(entry: Any) -> list[Any]:
    """The tensors a deferred GEMM reads in W: megatron-core's local linears' (input, output gradient),
    Transformer Engine's closure arguments."""
    if isinstance(entry, _Deferred):
        return [entry.input, entry.grad_output]
    if isinstance(entry, TeDeferred):
        return list(entry.tensors or [])
    raise TypeError(f"split backward with CUDA graphs: unknown deferred weight GEMM {type(entry).__name__}")


def with_operands(entry: Any, operands: list[Any]) -> Any:
    """``entry`` reading ``operands`` instead of its own (same order as :func:`deferred_operands`)."""
    if isinstance(entry, _Deferred):
        return dataclasses.replace(entry, input=operands[0], grad_output=operands[1])
    return dataclasses.replace(entry, tensors=list(operands))


def entry_name(entry: Any, index: int) -> str:
    """How an error names a deferred GEMM: its position in the backward and, for TE's, its module."""
    module = getattr(entry, "module_name", None)
    return f"weight GEMM {index + 1}" + (f" ({module}, Transformer Engine)" if module else "")


@dataclass(frozen=True)
class OperandPlan:
    """What a slot's I graph copies: per deferred GEMM (in backward order) which of its operands, and the
    buffers that hold them (the longest length's shape and dtype, in copy order)."""

    copies: tuple[tuple[int, ...], ...]
    buffers: tuple[tuple[torch.Size, torch.dtype], ...]

    def allocate(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.buffers]

    def nbytes(self) -> int:
        """Bytes of the buffers laid out one after another in a set (:class:`EvacuationSets`)."""
        return sum(_aligned(_size(shape, dtype)) for shape, dtype in self.buffers)


_ALIGN = 512
"""Bytes each buffer of an evacuation set starts on (a multiple of every dtype's size and of what the
kernels reading it vectorise on)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _size(shape: torch.Size, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class EvacuationSets:
    """The buffer sets a stage's slots evacuate W's operands into (module docstring): ``count`` flat
    allocations, each as large as the largest plan of the stage's chunks; a slot reads its plan's buffers
    as views laid out from the start of a set (:meth:`views`)."""

    def __init__(self, count: int, plans: list[OperandPlan], device: torch.device) -> None:
        if count < 1:
            raise ValueError(f"evacuation sets: {count}; at least one")
        self.nbytes = max((plan.nbytes() for plan in plans), default=0)
        self.arenas = [torch.empty(self.nbytes, dtype=torch.uint8, device=device) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.arenas)

    def views(self, index: int, plan: OperandPlan) -> list[torch.Tensor]:
        """Set ``index`` as ``plan``'s buffers (each the shape and dtype :meth:`OperandPlan.allocate` gives)."""
        if plan.nbytes() > self.nbytes:
            raise ValueError(f"evacuation sets of {self.nbytes} bytes: a plan needs {plan.nbytes()} (sized for the "
                             "stage's chunks before the first capture)")
        arena, start, views = self.arenas[index], 0, []
        for shape, dtype in plan.buffers:
            size = _size(shape, dtype)
            views.append(arena[start:start + size].view(dtype).view(shape))
            start += _aligned(size)
        return views


OPERAND_COPIES = ("auto", "lazy", "in-i")
"""--dpp-graph-operand-copies: when a slot copies W's operands (:func:`copies_wait`)."""


def copies_wait(plan: OperandPlan, mode: str = "auto") -> bool:
    """Whether a slot planned so leaves W's operands in the backward pool for an evacuation to copy if
    needed (True), or copies them inside I (False): ``auto`` (the default) and ``lazy`` wait, for
    megatron-core's local linears and Transformer Engine's alike; ``in-i`` copies in I. Nothing to copy:
    False."""
    if mode not in OPERAND_COPIES:
        raise ValueError(f"operand copies {mode!r}: one of {', '.join(OPERAND_COPIES)}")
    return any(plan.copies) and mode != "in-i"


def plan_operands(entries: list[Any], live: Live) -> OperandPlan:
    """The buffer plan for a backward that deferred ``entries`` (the warm-up's, at the longest length):
    every tensor operand that was not alive before the backward is copied."""
    copies, buffers = [], []
    for entry in entries:
        picked = []
        for k, operand in enumerate(deferred_operands(entry)):
            if isinstance(operand, torch.Tensor) and not live(operand):
                picked.append(k)
                buffers.append((operand.shape, operand.dtype))
        copies.append(tuple(picked))
    return OperandPlan(tuple(copies), tuple(buffers))


class StaticOperandStore(WeightGradStore):
    """The store a CUDA graph slot's I graph is captured with: each deferred GEMM's operands that the
    plan names go to the slot's buffers (views of their leading rows when the length is shorter than the
    longest). ``deferred=False``: copied inside the captured I, and the entry reads those copies in W.
    ``deferred=True`` (``buffers`` unused): I leaves them where the backward made them; :attr:`entries`
    read them there (the direct W), :meth:`copy_out_to` (an evacuation) copies them into a set of this
    plan's buffers (an :class:`EvacuationSets` set, or a slot's own), and :meth:`reading` gives the
    entries reading that set."""

    def __init__(self, buffers: list[torch.Tensor], copies: tuple[tuple[int, ...], ...],
                 deferred: bool = False) -> None:
        super().__init__()
        self.buffers, self.copies, self.deferred = buffers, copies, deferred
        self._next = 0  # copies inside I: the next buffer to fill
        self._planned: list[tuple[Any, list[Any], list[int]]] = []  # deferred: (entry, operands, copied k's)

    def add(self, entry: Any) -> None:
        i = len(self.entries)
        if i >= len(self.copies):
            raise RuntimeError(f"split backward with CUDA graphs: {entry_name(entry, i)} deferred, but the slot "
                               f"was planned for {len(self.copies)} (the backward defers more GEMMs than it did "
                               "when the buffers were sized)")
        operands = deferred_operands(entry)
        for k in self.copies[i]:
            if k >= len(operands) or not isinstance(operands[k], torch.Tensor):
                raise RuntimeError(f"split backward with CUDA graphs: {entry_name(entry, i)} has no tensor operand "
                                   f"{k + 1}, which the warm-up copied")
        if self.deferred:
            self._planned.append((entry, list(operands), list(self.copies[i])))
            super().add(with_operands(entry, list(operands)))  # a copy: W runs each entry once
            return
        for k in self.copies[i]:
            view = self._view(operands[k], entry_name(entry, i), k)
            view.copy_(operands[k])
            operands[k] = view
        super().add(with_operands(entry, operands))

    def copy_out_to(self, buffers: list[torch.Tensor]) -> int:
        """deferred: copy every planned operand from where the backward made it into its buffer of
        ``buffers`` (a set of this plan's buffers: what an evacuation graph captures); how many."""
        pairs = self._views_in(buffers)
        for view, operand in pairs:
            view.copy_(operand)
        return len(pairs)

    def reading(self, buffers: list[torch.Tensor]) -> list[Any]:
        """deferred: every entry as it reads its copied operands from ``buffers`` (a fresh list: a W runs
        each entry once)."""
        views = iter(view for view, _ in self._views_in(buffers))
        reading = []
        for entry, operands, picked in self._planned:
            operands = list(operands)
            for k in picked:
                operands[k] = next(views)
            reading.append(with_operands(entry, operands))
        return reading

    def filled(self) -> int:
        """Operands copied (inside I) or planned to be (deferred) so far."""
        return sum(len(picked) for _, _, picked in self._planned) if self.deferred else self._next

    def release(self) -> None:
        """Forget every entry and operand (after the slot's graphs are captured)."""
        self.entries.clear()
        self._planned.clear()

    def _pending_ops(self) -> list[tuple[int, torch.Tensor]]:
        return [(k, operands[k]) for _, operands, picked in self._planned for k in picked]

    def _views_in(self, buffers: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self.deferred:
            raise RuntimeError("a store that copies inside I has no other buffers to copy out to")
        pending = self._pending_ops()
        if len(buffers) != len(pending):
            raise RuntimeError(f"split backward with CUDA graphs: {len(pending)} operand(s) to evacuate into a set of "
                               f"{len(buffers)} buffer(s)")
        views = []
        for buffer, (_, operand) in zip(buffers, pending, strict=True):
            view = buffer[:operand.shape[0]] if operand.dim() else buffer
            if view.shape != operand.shape or view.dtype != operand.dtype:
                raise RuntimeError(f"split backward with CUDA graphs: an operand {tuple(operand.shape)} {operand.dtype} "
                                   f"does not fit its evacuation buffer {tuple(buffer.shape)} {buffer.dtype}")
            views.append((view, operand))
        return views

    def _view(self, operand: torch.Tensor, name: str, k: int) -> torch.Tensor:
        if self._next >= len(self.buffers):
            raise RuntimeError(f"split backward with CUDA graphs: {name}'s operand {k + 1} needs buffer "
                               f"{self._next + 1}, but the slot has {len(self.buffers)}")
        buffer = self.buffers[self._next]
        view = buffer[:operand.shape[0]] if operand.dim() else buffer
        if view.shape != operand.shape or view.dtype != operand.dtype:
            raise RuntimeError(f"split backward with CUDA graphs: {name}'s operand {k + 1} is "
                               f"{tuple(operand.shape)} {operand.dtype}, its buffer {tuple(view.shape)} {view.dtype} "
                               "(only the leading, sequence dimension may be shorter than the longest length's)")
        self._next += 1
        return view


def check_kept(store: StaticOperandStore, live: Live, length: int) -> None:
    """After an I capture: every operand the plan keeps must have been alive before it (else the shared
    backward pool would overwrite it before W), and every planned buffer must have been used."""
    for i, entry in enumerate(store.entries):
        for k, operand in enumerate(deferred_operands(entry)):
            if k not in store.copies[i] and isinstance(operand, torch.Tensor) and not live(operand):
                raise RuntimeError(f"split backward with CUDA graphs: at length {length}, {entry_name(entry, i)}'s "
                                   f"operand {k + 1} {tuple(operand.shape)} was allocated by the captured backward "
                                   "but the warm-up found it alive before its backward, so the slot does not copy "
                                   "it; the next backward replay would overwrite it before W")
    filled, planned = store.filled(), sum(map(len, store.copies))
    if not store.deferred:
        planned = len(store.buffers)
    if len(store.entries) != len(store.copies) or filled != planned:
        raise RuntimeError(f"split backward with CUDA graphs: the backward at length {length} deferred "
                           f"{len(store.entries)} weight GEMM(s) filling {filled} buffer(s); the warm-up "
                           f"planned {len(store.copies)} and {planned}")


def live_memory(device: torch.device) -> Live:
    """Whether a tensor lies in memory the CUDA caching allocator has handed out now (its active blocks):
    asked before a backward, true for what the backward did not allocate. Off CUDA (the CPU tests of
    what surrounds the graphs) nothing counts as alive, so every operand is copied."""
    if device.type != "cuda":
        return lambda tensor: False
    spans = sorted((block["address"], block["address"] + block["size"])
                   for segment in torch.cuda.memory_snapshot()
                   if segment.get("device", device.index) == device.index
                   for block in segment["blocks"] if block["state"] == "active_allocated")
    starts = [start for start, _ in spans]

    def live(tensor: torch.Tensor) -> bool:
        if tensor.device != device or tensor.numel() == 0:
            return True  # not in this device's pools, or nothing to read
        address = tensor.untyped_storage().data_ptr()
        i = bisect.bisect_right(starts, address) - 1
        return i >= 0 and address < spans[i][1]

    return live


class BackwardPoolState:
    """Which slot's W still reads its operands from a stage's shared backward pool, and which evacuation
    set holds whose (module docstring): :class:`~trainer.schedule.backward_pool.PoolState` decides, this
    replays what it decides.

    One per stage (all its chunks' slots share the pool and the sets). Before any backward graph of the
    stage replays -- an I or B, or a W -- :meth:`before_backward` evacuates the slot holding the pool into
    a free set, or, with every set taken, replays that slot's direct W at once; :meth:`replay_w` runs a
    slot's W: the direct one right after its I, the one reading its set after an evacuation, nothing if it
    ran early. A slot replay (trainer/pipeline/cuda_graphs.py ``_GraphPair``) that leaves operands in the
    pool carries ``evacs`` and ``wgts`` (set id -> graph) and ``wgt_direct``. Ranks of a tensor-parallel
    group replay the same graphs in the same order, so they decide alike."""

    def __init__(self) -> None:
        self.state = PoolState(lambda key: self._pairs[key].evacs)
        self._pairs: dict[int, Any] = {}  # id(pair) -> pair, for the slots that left operands in the pool
        self.shared: list[int] = []
        """The ids of the stage's shared evacuation sets, in :class:`EvacuationSets` order (:meth:`share`)."""
        self.sets: EvacuationSets | None = None
        """Held here, where every slot replay that reads or writes them refers: the graphs address their
        memory, which the caching allocator would hand to other tensors once unreferenced."""
        self._ids = itertools.count()

    def share(self, sets: EvacuationSets) -> None:
        """The stage's slots evacuate into ``sets`` (each slot captured afterwards may use every one)."""
        self.sets = sets
        self.shared = [next(self._ids) for _ in range(len(sets))]

    def own(self) -> int:
        """A set id for one slot's own buffers (``--dpp-graph-evacuation-sets slots``)."""
        return next(self._ids)

    @property
    def direct(self) -> int:
        """W graphs that read their operands in the pool (no copy made), right after their I."""
        return self.state.direct

    @property
    def evacuated(self) -> int:
        """Evacuations: a slot's operands copied to a set because another backward came first."""
        return self.state.evacuated

    @property
    def early(self) -> int:
        """W graphs replayed at once, before another backward, because every set the slot may use was taken."""
        return self.state.early

    def before_backward(self, pair: Any = None) -> None:
        """Another backward graph is about to replay (``pair``'s, if given): move the holder's operands
        out of the pool first (evacuated, or consumed by its W now)."""
        self._replay(self.state.backward(id(pair) if pair is not None else None))

    def after_i(self, pair: Any) -> None:
        """``pair``'s I replayed: its planned operands are in the pool until the next backward."""
        leaves = bool(getattr(pair, "evacs", None))
        if leaves:
            self._pairs[id(pair)] = pair
        self.state.after_i(id(pair), leaves)

    def replay_w(self, pair: Any) -> str:
        """``pair``'s W (a slot whose I left operands in the pool): ``direct`` (read in the pool), ``set``
        (read from the set its evacuation filled, which is free again after) or ``early`` (it ran in
        :meth:`before_backward`; nothing left to do)."""
        move, reads = self.state.weight(id(pair))
        self._replay(move)
        self._pairs.pop(id(pair), None)  # the state names it no more until its next I
        if reads == EARLY:
            return "early"
        if reads == DIRECT:
            pair.wgt_direct.replay()
            return "direct"
        pair.wgts[reads].replay()
        return "set"

    def _replay(self, move: Move | None) -> None:
        if move is None:
            return
        pair = self._pairs[move.key]
        if move.into is None:
            pair.wgt_direct.replay()
        else:
            pair.evacs[move.into].replay()
