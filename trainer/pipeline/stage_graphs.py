"""A stage's CUDA graph slots: capturing them (:func:`capture_chunk_graphs`), and ``--dpp-held-cap fit``,
which decides from the captured slots' measured memory how many this stage holds (:func:`fit_held_slots`).

Why fit (auto's choice for graphed dpp-zb at one chunk per stage): holding stage 0's 1F1B bound on
every stage ("peak") lets the later stages defer their W's, but under CUDA graphs each held microbatch is
a captured slot whose memory stays reserved, and a later stage's slot can cost more than stage 0's (the
split backward's operand buffers, the head). Measured on bert16-h2048 at PP=4 (one H200, the fused
optimizer step): peak made the last stage the job's largest rank, 10.91 GiB against stage 0's 8.99
(megatron-core's eager 1F1B: 8.41), while on the GPT benchmark model the same bound left stage 0 the
largest. Fit keeps what peak buys where the memory is there and nothing where it is not:

1. every stage captures its own 1F1B bound (p - s slots at PP=p), as 1F1B holds;
2. all ranks exchange what they reserve then, plus the optimizer state their first step will allocate
   (:class:`SlotReport`); the largest is the job's budget -- what 1F1B's bounds need anyway;
3. each stage captures one more slot at a time, up to the peak bound, while its reserved memory stays
   within that budget (predicted from its last slot's cost, then measured; a slot that did not fit is
   destroyed again);
4. the ranks of a stage (tensor- and data-parallel peers) keep the smallest count any of them reached,
   so they hold, and replay, the same slots; the policy's held cap becomes that count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.pipeline import cuda_graphs  # its functions through the module: tests and probes patch them
from trainer.pipeline.cuda_graphs import ChunkGraphs, GraphShapes
from trainer.pipeline.graph_operands import BackwardPoolState, EvacuationSets, copies_wait
from trainer.pipeline.split_backward import SplitBackward

log = logging.getLogger(__name__)
GIB = 2**30


def capture_chunk_graphs(chunks: list, shape, stage: int, slots: int | tuple[int, ...], shapes: GraphShapes,
                         masks: dict, device: torch.device, recompute_slots: int = 0,
                         split: SplitBackward | None = None, operand_copies: str = "auto",
                         evacuation_sets: int | None = None) -> dict[int, ChunkGraphs]:
    """Graph slots for each chunk of this stage (``slots``: one count for every chunk, or one per chunk --
    a static order's own peak per chunk; ``masks``: each captured length's attention mask;
    ``recompute_slots`` of each chunk's slots recompute the core attention, at most all of them;
    ``split``: the split-backward controller when the policy splits backwards into I and W;
    ``operand_copies``: --dpp-graph-operand-copies, trainer/pipeline/graph_operands.py;
    ``evacuation_sets``: how many sets of W's operands the stage's slots share, sized for the largest of
    its chunks' plans, so every chunk warms up before any captures; None: a set per slot,
    --dpp-graph-evacuation-sets). Before the first step: runs each block a few times on zero inputs
    (warm-up, capture; no gradient accumulates)."""
    per_chunk = (slots,) * len(chunks) if isinstance(slots, int) else tuple(slots)
    if len(per_chunk) != len(chunks):
        raise ValueError(f"stage {stage}: {len(per_chunk)} slot counts for {len(chunks)} chunk(s)")
    graphs = {}
    before = torch.cuda.memory_reserved(device)
    backward_pool = torch.cuda.graph_pool_handle()  # one backward workspace for the stage (capture_slot)
    pool_state = BackwardPoolState()  # which slot's W operands lie in it (graph_operands.py)
    recomputes = [min(recompute_slots, n) for n in per_chunk]
    plans = [cuda_graphs.warm_up_chunk(chunk, cuda_graphs.recompute_modes(per_chunk[c], recomputes[c]), shapes, masks,
                                       device, split) for c, chunk in enumerate(chunks)]
    lazy = [plan for plan in plans if plan is not None and copies_wait(plan, operand_copies)]
    sets = EvacuationSets(evacuation_sets, lazy, device) if evacuation_sets and lazy else None  # lazy: split only
    if sets is not None:
        pool_state.share(sets)
    for c, chunk in enumerate(chunks):
        graphs[c] = cuda_graphs.ChunkGraphs(chunk, shape.is_first_virtual(stage, c), per_chunk[c], shapes, masks, device,
                                backward_pool=backward_pool, recompute_slots=recomputes[c],
                                split=split, pool_state=pool_state, operand_copies=operand_copies,
                                warmed=(plans[c],), evacuation_sets=sets)
    cuda_graphs.release_cached_blocks(device)  # what the captures left in the ordinary pool (each warm-up's went before)
    log.info("stage %d: CUDA graphs for chunk(s) %s, %s slot(s) (%d recomputing the core attention%s), "
             "length(s) %s; %.2f GiB reserved for them; peak reserved so far %.2f GiB, allocated %.2f GiB",
             stage, sorted(graphs), "/".join(map(str, per_chunk)), min(recompute_slots, max(per_chunk)),
             ("; F, I and W graphs: split backward" if split else "")
             + (f"; W's operands evacuated into {len(sets)} set(s) of {sets.nbytes / GIB:.2f} GiB the slots share"
                if sets is not None else ""),
             ",".join(map(str, shapes.captured_lengths())), (torch.cuda.memory_reserved(device) - before) / GIB,
             torch.cuda.max_memory_reserved(device) / GIB, torch.cuda.max_memory_allocated(device) / GIB)
    return graphs


@dataclass(frozen=True)
class SlotReport:
    """One rank's memory at its stage's own 1F1B bound, as the ranks exchange it."""

    stage: int
    used: int
    """Bytes reserved with the own bound's slots captured, plus the optimizer state still to come."""
    per_slot: int
    """Bytes the stage's last captured slot added: the prediction for the next one."""


def memory_budget(reports: Sequence[SlotReport]) -> int:
    """The job's largest rank at the stages' own bounds: what no stage's extra slots may exceed."""
    return max(r.used for r in reports)


def agreed_slots(counts: Sequence[tuple[int, int]], stage: int) -> int:
    """The slots every rank of ``stage`` reached (``counts``: every rank's (stage, slots)): the smallest."""
    return min(n for s, n in counts if s == stage)


@dataclass(frozen=True)
class HeldFit:
    """What :func:`fit_held_slots` needs from the runtime."""

    own: int
    """This stage's 1F1B bound: the slots captured before fitting."""
    peak: int
    """The most slots the stage may hold (stage 0's bound: the policy's cap as built)."""
    pending_bytes: int
    """Optimizer state this rank's first step will allocate (not reserved yet at capture)."""
    gather: Callable[[Any], list[Any]]
    """Every rank's value of an object, in rank order (an all-gather over the job)."""
    reserved: Callable[[], int]
    """This process's reserved device memory now (``torch.cuda.memory_reserved``)."""


def fit_held_slots(graphs: ChunkGraphs, stage: int, fit: HeldFit, device: torch.device) -> int:
    """Steps 2-4 of the module docstring for a stage whose one chunk holds ``fit.own`` slots; returns the
    slots it keeps (the policy's held cap). Every rank of the job calls it once, in set-up."""
    def used() -> int:
        cuda_graphs.release_cached_blocks(device)  # what a capture left in the ordinary pool is not the slot's
        return fit.reserved() + fit.pending_bytes

    mine = SlotReport(stage, used(), graphs.slot_bytes[-1] if graphs.slot_bytes else 0)
    budget = memory_budget(fit.gather(mine))
    count, now, per_slot = len(graphs.slots), mine.used, mine.per_slot
    while count < fit.peak and now + per_slot <= budget:
        graphs.resize(count + 1)
        after = used()
        if after > budget:  # the prediction was short: this slot does not fit
            graphs.resize(count)
            break
        count, per_slot, now = count + 1, after - now, after
    agreed = agreed_slots(fit.gather((stage, count)), stage)
    if agreed < count:
        graphs.resize(agreed)
        now = used()
    log.info("stage %d: held cap fitted to memory: %d slot(s) (its 1F1B bound %d, at most %d); %.2f GiB with "
             "the optimizer state to come, within the job's budget of %.2f GiB (the largest rank at the "
             "stages' own bounds)", stage, agreed, fit.own, fit.peak, now / GIB, budget / GIB)
    return agreed
