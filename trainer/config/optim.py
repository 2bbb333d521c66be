"""The optimizer section: batch sizes (with Megatron-LM's --rampup-batch-size), the optimizer and the
learning-rate schedule, as a typed frozen dataclass with Megatron-LM's flag names. Like every section
(trainer/config/sections.py) it checks its own fields; a field's docstring is its ``--help`` text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config.rampup import BatchRampup
from trainer.config.sections import _check

DECAY_STYLES = ("constant", "linear", "cosine")
TORCH_OPTIMIZER_IMPLS = ("auto", "foreach", "fused")
DEFAULT_TRAIN_ITERS = 10  # without --train-iters or --train-samples (Megatron-LM requires one)


@dataclass(frozen=True)
class OptimConfig:
    """Batch sizes, optimizer and learning-rate schedule (Megatron-LM's names)."""

    micro_batch_size: int = 1
    """Samples per microbatch (``--micro-batch-size``)."""
    global_batch_size: int = 8
    """Samples per iteration over all DP replicas (``--global-batch-size``)."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron-LM's): the global batch starts at START
    and grows by INCREMENT every SAMPLES / ((--global-batch-size - START) / INCREMENT) consumed samples
    until --global-batch-size (trainer/config/rampup.py); so the microbatch count changes between
    iterations. With --train-samples the iteration count follows the ramp (Megatron-LM's
    update_train_iters); with --train-iters it is that many iterations."""
    train_iters: int | None = None
    """Iterations to train (``--train-iters``); None: --train-samples // --global-batch-size when
    --train-samples is given, else 10. Exclusive with --train-samples (Megatron-LM's rule)."""
    train_samples: int | None = None
    """Sample-based training (``--train-samples``), as Megatron-LM: train_samples // global_batch_size
    iterations (a partial last batch is dropped); the LR schedule is then given in samples."""
    lr: float = 1e-3
    """Peak learning rate (``--lr``)."""
    min_lr: float = 0.0
    """Floor of the decay (``--min-lr``)."""
    lr_warmup_iters: int = 0
    """Linear warm-up iterations (``--lr-warmup-iters``); iteration-based training only."""
    lr_warmup_samples: int = 0
    """Linear warm-up in samples (``--lr-warmup-samples``); with --train-samples only."""
    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of the decay length (``--lr-warmup-fraction``), in either mode; exclusive
    with --lr-warmup-iters / --lr-warmup-samples."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    """Decay after warm-up (``--lr-decay-style``)."""
    lr_decay_iters: int | None = None
    """Iterations over which to decay; None means the training length. Iteration-based only."""
    lr_decay_samples: int | None = None
    """Samples over which to decay (``--lr-decay-samples``); None means --train-samples. With
    --train-samples only."""
    weight_decay: float = 0.01
    """AdamW weight decay (``--weight-decay``)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables (``--clip-grad``)."""
    adam_beta1: float = 0.9
    """Adam beta1 (``--adam-beta1``)."""
    adam_beta2: float = 0.999
    """Adam beta2 (``--adam-beta2``)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """``--optimizer`` (Megatron-LM's): megatron-core's Adam(W) or SGD (momentum 0.9, Megatron's
    default), both with fp32 main weights under --bf16/--fp16."""
    torch_optimizer_impl: Literal["auto", "foreach", "fused"] = "auto"
    """Where megatron-core falls back to torch's own AdamW / SGD (neither Transformer Engine nor Apex
    installed), which torch step runs (``--torch-optimizer-impl``; trainer/session/optimizer_impl.py):
    ``foreach`` (torch's default) allocates temporaries as large as all of the rank's fp32 main parameters,
    ``fused`` none (what Transformer Engine's and Apex's FusedAdam do). Under the DPP runtime's CUDA graphs
    those temporaries add to the peak reserved memory (the activations sit in the graphs' own pools, so the
    step cannot reuse their memory as it does under megatron-core's eager schedules). ``auto``: fused on
    CUDA, foreach on the CPU (:func:`resolve_torch_optimizer_impl`). A checkpoint saved with either resumes
    with either (the same state; the restored step counts move to where the chosen step keeps them)."""
    seed: int = 1234
    """Seed for initialisation, dropout and mock data (``--seed``)."""
    bf16: bool = False
    """bfloat16 parameters and compute with fp32 main weights (``--bf16``)."""
    fp16: bool = False
    """float16 with dynamic loss scaling (``--fp16``)."""

    def __post_init__(self) -> None:
        p = [f"--{n.replace('_', '-')}={getattr(self, n)} must be >= 1"
             for n in ("micro_batch_size", "global_batch_size") if getattr(self, n) < 1]
        p.extend(self._schedule_problems())
        if self.rampup_batch_size is not None:
            object.__setattr__(self, "rampup_batch_size", tuple(self.rampup_batch_size))
        if self.rampup is not None:
            # With --train-iters too: Megatron-LM up to core_v0.16 refused that pairing although its own
            # examples/gpt3/train_gpt3_175b_distributed.sh passes it; later releases accept it (the run is
            # --train-iters iterations, the ramp still decided by consumed samples), as here.
            p.extend(self.rampup.problems())
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            p.append(f"--lr={self.lr} / --min-lr={self.min_lr} need 0 <= min-lr <= lr and lr > 0")
        if self.lr_decay_style not in DECAY_STYLES:
            p.append(f"--lr-decay-style={self.lr_decay_style!r} must be one of {', '.join(DECAY_STYLES)}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            p.append(f"--weight-decay={self.weight_decay} and --clip-grad={self.clip_grad} must be >= 0")
        if self.bf16 and self.fp16:
            p.append("--bf16 and --fp16 are mutually exclusive")
        if self.optimizer not in ("adam", "sgd"):
            p.append(f"--optimizer={self.optimizer!r} must be adam or sgd")
        if self.torch_optimizer_impl not in TORCH_OPTIMIZER_IMPLS:
            p.append(f"--torch-optimizer-impl={self.torch_optimizer_impl!r} must be one of "
                     f"{', '.join(TORCH_OPTIMIZER_IMPLS)}")
        _check(p)

    def _schedule_problems(self) -> list[str]:
        """Megatron-LM's rules for iteration- vs sample-based training (validate_args), plus the ranges
        and megatron-core's OptimizerParamScheduler assertion (warm-up shorter than decay) up front."""
        p = [f"--{n.replace('_', '-')}={getattr(self, n)} must be >= 1"
             for n in ("train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples")
             if getattr(self, n) is not None and getattr(self, n) < 1]
        p.extend(f"--{n.replace('_', '-')}={getattr(self, n)} must be >= 0"
                 for n in ("lr_warmup_iters", "lr_warmup_samples") if getattr(self, n) < 0)
        fraction = self.lr_warmup_fraction
        if fraction is not None and not 0.0 <= fraction < 1.0:
            p.append(f"--lr-warmup-fraction={fraction} must be in [0, 1)")
        if self.train_samples is not None:
            wrong = [(n, v) for n, v in (("train_iters", self.train_iters), ("lr_decay_iters", self.lr_decay_iters))
                     if v is not None] + ([("lr_warmup_iters", self.lr_warmup_iters)] if self.lr_warmup_iters else [])
            p.extend(f"--{n.replace('_', '-')}={v} is iteration-based but --train-samples={self.train_samples} "
                     "asks for sample-based training" for n, v in wrong)
            if fraction is not None and self.lr_warmup_samples:
                p.append(f"--lr-warmup-fraction={fraction} and --lr-warmup-samples={self.lr_warmup_samples}: "
                         "give only one")
            # The first iteration's batch: --rampup-batch-size's start, else --global-batch-size.
            first = self.rampup_batch_size[0] if self.rampup_batch_size else self.global_batch_size
            if first >= 1 and 1 <= self.train_samples < first:
                p.append(f"--train-samples={self.train_samples} is less than one iteration of "
                         + (f"--rampup-batch-size's start {first}" if self.rampup_batch_size else
                            f"--global-batch-size={self.global_batch_size}"))
        else:
            p.extend(f"--{n.replace('_', '-')}={v} is sample-based: it needs --train-samples"
                     for n, v in (("lr_decay_samples", self.lr_decay_samples),
                                  ("lr_warmup_samples", self.lr_warmup_samples or None)) if v is not None)
            if fraction is not None and self.lr_warmup_iters:
                p.append(f"--lr-warmup-fraction={fraction} and --lr-warmup-iters={self.lr_warmup_iters}: "
                         "give only one")
        if not p and self.global_batch_size >= 1:
            warmup, decay, _ = self.lr_schedule_samples
            if warmup >= decay:
                p.append(f"LR warm-up of {warmup:g} samples is not shorter than the decay of {decay:g} samples "
                         "(--lr-warmup-* against --lr-decay-* or the training length)")
        return p

    @property
    def total_iters(self) -> int:
        """Iterations this run trains: --train-iters, else --train-samples // --global-batch-size
        (Megatron-LM's update_train_iters, no batch-size ramp-up), else 10."""
        if self.train_iters is not None:
            return self.train_iters
        if self.train_samples is not None and self.rampup is not None and not self.rampup.problems():
            return self.rampup.train_iters(self.train_samples)
        if self.train_samples is not None:
            return self.train_samples // self.global_batch_size
        return DEFAULT_TRAIN_ITERS

    @property
    def rampup(self) -> BatchRampup | None:
        """--rampup-batch-size as a calculator (None without it)."""
        if self.rampup_batch_size is None:
            return None
        start, increment, samples = self.rampup_batch_size
        return BatchRampup(start, increment, samples, self.global_batch_size)

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the iteration after ``consumed_samples`` samples (--rampup-batch-size,
        else --global-batch-size)."""
        ramp = self.rampup
        return ramp.batch_size_at(consumed_samples) if ramp is not None else self.global_batch_size

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Every global batch size the run uses (one without --rampup-batch-size)."""
        ramp = self.rampup
        return ramp.sizes() if ramp is not None and not ramp.problems() else (self.global_batch_size,)

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.total_iters

    @property
    def lr_schedule_samples(self) -> tuple[float, int, int]:
        """(warm-up, decay, weight-decay increment) lengths in samples, the units megatron-core's
        OptimizerParamScheduler steps in (by global batch size), computed as Megatron-LM's
        get_optimizer_param_scheduler does in both modes; a warm-up fraction is of the decay."""
        gbs = self.global_batch_size
        if self.train_samples is not None:
            decay, wd_incr = self.lr_decay_samples or self.train_samples, self.train_samples
            warmup: float = self.lr_warmup_samples
        else:
            decay, wd_incr = self.decay_iters * gbs, self.total_iters * gbs
            warmup = self.lr_warmup_iters * gbs
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return warmup, decay, wd_incr


def resolve_torch_optimizer_impl(requested: str, device: str) -> tuple[str, str]:
    """(the torch step ``--torch-optimizer-impl`` runs, why): auto is fused on CUDA and foreach on the CPU.

    Fused on CUDA because the foreach step's temporaries, as large as all of a rank's fp32 main parameters,
    are what put graphed DPP above megatron-core's memory (the benchmark model, PP=4, stage 0 of graphed
    dpp-zb with Adam on an H200: 14.80 GiB reserved with foreach, 13.71 GiB fused, the eager runtime at
    1F1B's caps 13.07 GiB either way), and a fused step is what Megatron-LM users run anyway (Transformer
    Engine's or Apex's FusedAdam). Foreach on the CPU: no memory to save there, and torch's default."""
    if requested != "auto":
        return requested, f"--torch-optimizer-impl {requested}"
    if device == "cuda":
        return "fused", "auto: fused on CUDA (no step temporaries the size of the parameters)"
    return "foreach", f"auto: torch's default on {device}"
