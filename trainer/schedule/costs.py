"""Cost model of the simulator: per-op compute times with the variation real pipelines see.

Times are in arbitrary units (one forward of a whole stage = 1.0 by default). A stage's cost is
split evenly over its ``v`` chunks. Variation models, all seeded:

* **sequence lengths**: microbatch ``m`` has a log-normal length ratio ``r`` (mean 1); its ops on
  every stage cost ``(1 - a) r + a r^2`` times nominal, ``a`` being attention's quadratic share;
* **jitter**: every op independently times a log-normal factor of mean 1 and coefficient of
  variation ``jitter`` (0.3 = 30% standard deviation: kernels, clocks, interference);
* **straggler**: one stage is ``straggler_factor`` times slower on every op;
* **transient stalls**: each op independently, with probability ``stall_probability``, is held up
  ``stall_duration`` longer (a GC pause, a preempted kernel, a host hiccup): rare, large, and
  unpredictable, unlike lengths, which the runtime knows before the forward;
* **stage scale**: a fixed cost multiplier per stage (e.g. an uneven layer split, or the extra
  embedding / output-head work of the first / last stage: :mod:`trainer.schedule.layers`);
* **stage ops**: measured per-stage F, I and W times, replacing the nominal three (a stage's ratio
  of I to W differs with what it holds: the output head's GEMMs split otherwise than a layer's).

A full backward B costs I + W of the same draws, so split and unsplit schedules see the same work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainer.problems import raise_if_any
from trainer.schedule.core import Op, PipelineShape


@dataclass(frozen=True)
class CostModel:
    """Nominal costs and variation models of one simulated step."""

    forward: float = 1.0
    """Forward time of one microbatch through one whole stage (all its chunks)."""
    input_grad: float = 1.0
    """Input-gradient (I) time of one microbatch through one stage."""
    weight_grad: float = 1.0
    """Weight-gradient (W) time of one microbatch through one stage; B = I + W."""
    transfer: float = 0.0
    """Time for an activation or gradient to cross one pipeline edge (compute never waits on a
    send: transfers overlap with compute, as with a dedicated copy engine)."""
    edge_transfer: tuple[float, ...] = ()
    """Per-edge override of ``transfer``: entry ``s`` is the time to cross edge s -> s+1 (the
    last one is the wrap-around p-1 -> 0 of interleaving), both directions. Empty: ``transfer``
    everywhere. E.g. a slower inter-node edge in the middle of the pipeline."""
    jitter: float = 0.0
    """Coefficient of variation of the independent per-op log-normal noise (0 = none)."""
    seq_len_sigma: float = 0.0
    """Sigma of the log-normal per-microbatch sequence-length ratio (0 = all equal)."""
    attention_fraction: float = 0.2
    """Share of a nominal-length op's cost that grows quadratically with sequence length."""
    straggler_stage: int | None = None
    """Stage that is uniformly slower, or None."""
    straggler_factor: float = 1.0
    """How much slower the straggler stage is (1.2 = 20% slower)."""
    stall_probability: float = 0.0
    """Chance that one op of a whole stage is held up by a transient stall (0 = never); a
    chunk's op (1/v of a stage) has 1/v of it, so every v sees the same stalls per stage."""
    stall_duration: float = 0.0
    """Time a stalled op takes on top of its cost (units of one stage's forward)."""
    stall_stage: int | None = None
    """Only this stage's ops stall (the benchmark's scenario c delays one rank's); None: every stage's."""
    stall_ops: str = "FIW"
    """Which ops stall: any of F, I, W (a whole backward B = I + W meets the stalls of both)."""
    stage_scale: tuple[float, ...] = ()
    """Cost multiplier of each stage (one entry per stage; empty: all 1). E.g. the per-stage work
    of a layer split with the head's extra work (``trainer.schedule.layers.stage_costs``)."""
    stage_ops: tuple[tuple[float, float, float], ...] = ()
    """(F, I, W) of one microbatch on each stage (one entry per stage, its chunks taking 1/v each;
    empty: ``forward``, ``input_grad``, ``weight_grad`` everywhere): measured op times, e.g. per
    layer, embedding and head times summed over a split (``trainer.schedule.layers.LayerOps``). Or
    one entry per virtual stage (p x v, model order: chunk c of stage s at c * p + s), each that
    chunk's own times: where a stage's chunks differ (the embedding in chunk 0 of stage 0, the head
    in the last chunk of the last stage, a split per virtual stage); a one-chunk schedule runs each
    stage's entries summed. ``stage_scale`` still multiplies them."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("forward", "input_grad", "weight_grad"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                problems.append(f"{name}={value} must be a finite number > 0")
        for name in ("transfer", "jitter", "seq_len_sigma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name}={value} must be a finite number >= 0")
        bad_edges = [t for t in self.edge_transfer if not (math.isfinite(t) and t >= 0)]
        if bad_edges:
            problems.append(f"edge_transfer={self.edge_transfer} has values that are not finite"
                            f" numbers >= 0: {bad_edges}")
        if not 0 <= self.attention_fraction <= 1:
            problems.append(f"attention_fraction={self.attention_fraction} must lie in [0, 1]")
        if not 0 <= self.stall_probability <= 1:
            problems.append(f"stall_probability={self.stall_probability} must lie in [0, 1]")
        if not (math.isfinite(self.stall_duration) and self.stall_duration >= 0):
            problems.append(f"stall_duration={self.stall_duration} must be a finite number >= 0")
        if self.stall_stage is not None and self.stall_stage < 0:
            problems.append(f"stall_stage={self.stall_stage} must be >= 0")
        if not self.stall_ops or set(self.stall_ops) - set("FIW"):
            problems.append(f"stall_ops={self.stall_ops!r} must be one or more of F, I, W")
        bad_scale = [x for x in self.stage_scale if not (math.isfinite(x) and x > 0)]
        if bad_scale:
            problems.append(f"stage_scale={self.stage_scale} has values that are not finite numbers"
                            f" > 0: {bad_scale}")
        bad_ops = [ops for ops in self.stage_ops
                   if len(ops) != 3 or not all(math.isfinite(x) and x > 0 for x in ops)]
        if bad_ops:
            problems.append(f"stage_ops={self.stage_ops} has entries that are not three finite numbers"
                            f" > 0 (F, I, W): {bad_ops}")
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor > 0):
            problems.append(f"straggler_factor={self.straggler_factor} must be a finite number > 0")
        if self.straggler_stage is not None and self.straggler_stage < 0:
            problems.append(f"straggler_stage={self.straggler_stage} must be >= 0")
        raise_if_any(problems, "invalid cost model")

    @property
    def is_uniform(self) -> bool:
        return (self.jitter == 0 and self.seq_len_sigma == 0 and self.straggler_factor == 1.0
                and (self.stall_probability == 0 or self.stall_duration == 0)
                and len(set(self.stage_scale)) <= 1 and len(set(self.stage_ops)) <= 1)

    def _chunk_nominal(self, p: int, v: int) -> list[np.ndarray]:
        """F, I, W of one microbatch on each chunk, each shaped [stage][chunk][1]."""
        given = len(self.stage_ops) // p if self.stage_ops else 0
        if given > 1:  # per virtual stage, model order
            per = np.asarray(self.stage_ops, dtype=float).reshape(given, p, 3)  # [chunk][stage][op]
            if v == 1:  # a one-chunk schedule (e.g. the 1F1B baseline) runs a stage's chunks as one
                per = per.sum(axis=0, keepdims=True)
            return [per[:, :, k].T[:, :, None] for k in range(3)]
        nominal = (list(zip(*self.stage_ops, strict=True)) if self.stage_ops
                   else (self.forward, self.input_grad, self.weight_grad))
        return [np.asarray(x, dtype=float).reshape(-1, 1, 1) / v * np.ones((1, v, 1)) for x in nominal]

    def draw(self, shape: PipelineShape, rng: np.random.Generator) -> CostTable:
        """One random realisation of every op's duration for ``shape``."""
        p, v, m = shape.num_stages, shape.num_chunks, shape.num_microbatches
        for name in ("straggler_stage", "stall_stage"):
            if getattr(self, name) is not None and getattr(self, name) >= p:
                raise ValueError(f"{name}={getattr(self, name)} outside [0, num_stages={p})")
        if self.edge_transfer and len(self.edge_transfer) != p:
            raise ValueError(f"edge_transfer has {len(self.edge_transfer)} entries, need one per edge:"
                             f" num_stages={p}")
        if self.stage_scale and len(self.stage_scale) != p:
            raise ValueError(f"stage_scale has {len(self.stage_scale)} entries, need one per stage:"
                             f" num_stages={p}")
        entries = len(self.stage_ops)
        if entries and not (entries in (p, p * v) or (v == 1 and entries % p == 0)):
            raise ValueError(f"stage_ops has {len(self.stage_ops)} entries, need one per stage (num_stages={p})"
                             f" or one per virtual stage ({p * v})")
        scale = np.ones((p, v, m))
        microbatch_cost = np.ones(m)
        if self.seq_len_sigma > 0:
            ratio = _mean_one_lognormal(rng, self.seq_len_sigma, m)
            a = self.attention_fraction
            microbatch_cost = (1 - a) * ratio + a * ratio**2
            scale *= microbatch_cost[None, None, :]
        if self.stage_scale:
            scale *= np.asarray(self.stage_scale)[:, None, None]
        if self.straggler_stage is not None:
            scale[self.straggler_stage] *= self.straggler_factor
        jitter_sigma = math.sqrt(math.log1p(self.jitter**2))  # log-normal sigma giving that CV

        def op_times(per_chunk: np.ndarray) -> np.ndarray:
            times = scale * per_chunk
            if self.jitter > 0:
                times = times * _mean_one_lognormal(rng, jitter_sigma, times.shape)
            return times

        forward, input_grad, weight_grad = (op_times(x) for x in self._chunk_nominal(p, v))
        if self.stall_probability > 0 and self.stall_duration > 0:
            # Drawn last, so turning stalls on leaves every other draw of a seed as it was.
            # Per chunk op 1/v of the chance: a stage meets as many stalls whatever v is.
            # The same draws whichever stage and ops stall: a seed's stalls only narrow to them.
            chance = self.stall_probability / v
            where = np.ones((p, 1, 1)) if self.stall_stage is None else (np.arange(p) == self.stall_stage)[:, None, None]
            forward, input_grad, weight_grad = (
                t + self.stall_duration * (rng.random(t.shape) < chance) * where * (op in self.stall_ops)
                for op, t in zip("FIW", (forward, input_grad, weight_grad), strict=True))
        edges = list(self.edge_transfer) if self.edge_transfer else [self.transfer] * p
        hints = microbatch_cost.tolist() if self.seq_len_sigma > 0 else None  # None: all alike
        return CostTable(forward, input_grad, weight_grad, edges, hints)


def _mean_one_lognormal(rng: np.random.Generator, sigma: float, size) -> np.ndarray:
    return np.exp(sigma * rng.standard_normal(size) - sigma**2 / 2)


class CostTable:
    """Durations of every op of one step, indexed ``[op][stage][chunk][microbatch]`` (nested
    lists: the event loop reads single items, where lists beat numpy indexing by ~10x)."""

    def __init__(self, forward: np.ndarray, input_grad: np.ndarray, weight_grad: np.ndarray,
                 edge_transfer: list[float], microbatch_cost: list[float] | None = None) -> None:
        self.edge_transfer = edge_transfer
        """Time to cross edge s -> s+1 (mod p), both directions."""
        self.microbatch_cost = microbatch_cost
        """What the runtime can know of each microbatch's cost before running it: the
        sequence-length factor (None without variable lengths: all alike); jitter and stalls are not
        in it. The simulator hands it to the policies as ``StageState.microbatch_costs``."""
        self.durations = {
            Op.F: forward.tolist(),
            Op.I: input_grad.tolist(),
            Op.W: weight_grad.tolist(),
            Op.B: (input_grad + weight_grad).tolist(),
        }
        self.stage_work = (forward + input_grad + weight_grad).sum(axis=(1, 2))
        """Total compute of each stage: the same for every schedule."""
