"""The order-free bound: the shortest step any schedule could run on one draw of op costs.

The balanced limit (every stage's work summed, divided by the stages) says what a perfect *split* would
reach; it ignores that a pipeline fills. This bound keeps the split and the chunks as they are and asks
only what no order can avoid, whatever its memory:

* nothing runs on stage ``s`` before some microbatch's first activation reaches it (the forward of
  chunk 0 on every earlier stage, and the hops between), and the stage then has all of its work to do,
  one op at a time;
* no backward op (B, I or W) runs on stage ``s`` before some microbatch's first gradient reaches it (the
  forward through every virtual stage, then the input gradients down to the stage's last chunk: I's, as a
  split backward sends them; a whole backward sends its gradient after its W as well, so the bound is
  looser for it), and the stage then has all of its backward work to do.

Whichever of the two is longer, on whichever stage, is the bound. A schedule's step over it is what its
order costs on these costs: the dynamic policies' room to gain over a static order is at most the static
order's step over the bound. A microbatch that could go first is any one (the minimum over them), so the
bound holds under varying lengths as well; host latencies the table does not hold (launches, headers)
only make it looser.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.schedule.core import Op
from trainer.schedule.costs import CostTable


@dataclass(frozen=True)
class OrderFreeBound:
    """The bound of one cost draw and where it comes from."""

    step: float
    """No schedule of these costs finishes its step sooner."""
    stage: int
    """The stage the bound comes from."""
    start: float
    """When that stage can start at the earliest: its first input's arrival, or its first gradient's."""
    work: float
    """What it must run from then on: all its work, or all its backward work."""
    backward: bool
    """Whether the bound is the backward's (first gradient, backward work) rather than the stage's."""
    balanced: float
    """The balanced limit of the same costs: every stage's work summed, divided by the stages."""

    def describe(self) -> str:
        what = "its first gradient" if self.backward else "its first input"
        work = "its backward work" if self.backward else "its work"
        return (f"{self.step:.2f} (stage {self.stage}: {what} at {self.start:.2f} at the earliest, then "
                f"{work}, {self.work:.2f}); balanced limit {self.balanced:.2f}")


def order_free_bound(table: CostTable) -> OrderFreeBound:
    """The :class:`OrderFreeBound` of one drawn step (the module docstring says what it assumes)."""
    forward, input_grad, weight_grad = (np.asarray(table.durations[op], dtype=float) for op in (Op.F, Op.I, Op.W))
    p, v, _ = forward.shape
    virtual = range(p * v)  # virtual stage k is chunk k // p of stage k % p, in model order
    fwd = np.stack([forward[k % p, k // p] for k in virtual])  # [virtual stage][microbatch]
    igrad = np.stack([input_grad[k % p, k // p] for k in virtual])
    # Crossing from virtual stage k to k + 1 takes edge k % p (the last edge is the wrap-around p-1 -> 0).
    hop = np.asarray([table.edge_transfer[k % p] for k in range(p * v - 1)], dtype=float)
    before = np.concatenate([np.zeros((1, fwd.shape[1])), np.cumsum(fwd[:-1] + hop[:, None], axis=0)])
    # What reaches virtual stage k's backward: the whole forward, then the input gradients (and hops) of
    # the virtual stages after k, taken from the last one down.
    whole_forward = before[-1] + fwd[-1]
    after = np.zeros_like(fwd)
    for k in range(p * v - 2, -1, -1):
        after[k] = after[k + 1] + igrad[k + 1] + hop[k]
    work = (forward + input_grad + weight_grad).sum(axis=(1, 2))
    backward_work = (input_grad + weight_grad).sum(axis=(1, 2))
    candidates = []
    for s in range(p):
        first_input = float(before[s].min())  # chunk 0 of stage s is virtual stage s
        first_gradient = float((whole_forward + after[(v - 1) * p + s]).min())  # its last chunk's comes first
        candidates.append((first_input + float(work[s]), s, first_input, float(work[s]), False))
        candidates.append((first_gradient + float(backward_work[s]), s, first_gradient, float(backward_work[s]), True))
    step, stage, start, stage_work, backward = max(candidates)
    return OrderFreeBound(step, stage, start, stage_work, backward, float(work.sum()) / p)
