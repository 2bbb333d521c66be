"""What a training run prints and records as it goes: the first line (the layout and the plan's
schedule), Megatron-LM's iteration and validation lines, and --tensorboard-dir's scalars.

The lines are printed by the last stage's first rank (where the losses are), the first line also by
rank 0; the GPU memory peak is a collective every rank takes part in.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from trainer.config import RunPlan, TrainConfig
from trainer.launch.topology import Topology

log = logging.getLogger("trainer.train")


class RunLog:
    """The run's log lines and TensorBoard writer."""

    def __init__(self, cfg: TrainConfig, plan: RunPlan, topology: Topology, rank: int, device: torch.device) -> None:
        self.cfg, self.plan, self.topology, self.rank, self.device = cfg, plan, topology, rank, device
        # Megatron-LM's per-log-interval counters: optimizer steps skipped (fp16 overflow) and, of
        # those, steps whose loss was inf/nan; printed and reset by each iteration line.
        self.skipped_iterations = self.nan_iterations = 0
        self.tensorboard = None  # --tensorboard-dir's SummaryWriter, on the logging rank only
        if cfg.run.tensorboard_dir and self.is_logger:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=cfg.run.tensorboard_dir, max_queue=1000)

    @property
    def is_logger(self) -> bool:
        t = self.topology
        return t.is_last_stage and t.tp_rank == 0 and t.dp_rank == 0

    def layout(self, chunks: list, vocab_size: int, resume_iteration: int) -> None:
        """The run's first line: model, layout, batch, the plan's schedule (and why), transport, sizes."""
        cfg, t = self.cfg, self.topology
        params = torch.tensor([sum(p.numel() for c in chunks for p in c.parameters())], dtype=torch.float64)
        if cfg.run.device == "cuda":
            params = params.cuda()
        if self.rank == 0 or self.is_logger:
            log.info("run %s: %s %s | %s%s | microbatches/iter %d x mbs %d | schedule %s | "
                     "transport %s | vocab %d (padded %d) | this rank holds %.2fM parameters | "
                     "resuming at iteration %d", cfg.run.run_name, cfg.model.model.upper(),
                     f"{cfg.model.num_layers}L h{cfg.model.hidden_size}", t.describe(),
                     f" layers {self.plan.layers.describe()}" if t.pipeline_parallel > 1 else "", self.plan.num_microbatches,
                     cfg.optim.micro_batch_size, self.plan.schedule.log_text,
                     self.plan.links.transport if t.pipeline_parallel > 1 else "none", vocab_size,
                     cfg.model.padded_vocab_size(vocab_size, t.tensor_parallel), float(params.item()) / 1e6,
                     resume_iteration)

    def step_done(self, success: bool, losses: dict[str, float]) -> None:
        """Count a step the optimizer skipped (and whether its loss was inf/nan)."""
        if not success:
            self.skipped_iterations += 1
            self.nan_iterations += not all(math.isfinite(v) for v in losses.values())

    def scalars(self, iteration: int, losses: dict[str, float], lr: float, loss_scale: float, grad_norm) -> None:
        """Megatron-LM's TensorBoard tags, every iteration."""
        if self.tensorboard is None:
            return
        for key, value in losses.items():
            self.tensorboard.add_scalar(key, value, iteration)
        self.tensorboard.add_scalar("learning-rate", lr, iteration)
        self.tensorboard.add_scalar("loss-scale", loss_scale, iteration)
        if grad_norm is not None:
            self.tensorboard.add_scalar("grad-norm", grad_norm, iteration)

    def _peak_memory_gib(self) -> float | None:
        """Largest peak of allocated GPU memory over all ranks (stage 0 usually holds the most
        activations). COLLECTIVE on CUDA; None on CPU."""
        if self.cfg.run.device != "cuda":
            return None
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak.item())

    def iteration(self, iteration: int, consumed_samples: int, losses: dict[str, float], grad_norm, lr: float,
                  loss_scale: float, seconds: float, padded_vocab_size: int, global_batch_size: int | None = None) -> None:
        """Megatron-LM's iteration line. COLLECTIVE on CUDA (the memory peak): every rank calls it.
        ``global_batch_size``: this iteration's (--rampup-batch-size changes it), default --global-batch-size."""
        peak = self._peak_memory_gib()  # every rank takes part, so before the logger check
        skipped, nans = self.skipped_iterations, self.nan_iterations
        self.skipped_iterations = self.nan_iterations = 0
        if not self.is_logger:
            return
        cfg = self.cfg
        memory = f" | peak memory (GiB, max over ranks): {peak:.2f}" if peak is not None else ""
        batch = global_batch_size or cfg.optim.global_batch_size
        tokens = batch * cfg.model.seq_length
        loss_text = " | ".join(f"{k}: {v:.6E}" for k, v in losses.items())
        norm = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
        throughput = ""
        if cfg.run.log_throughput:  # where Megatron-LM puts it: right after the iteration time
            from trainer.measure.flops import tflops_per_gpu

            tflops = tflops_per_gpu(cfg, padded_vocab_size, seconds, self.plan.world_size, batch)
            throughput = f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
        # Megatron-LM's fields in its order; tokens/s and peak memory are this trainer's additions.
        log.info("iteration %8d/%8d | consumed samples: %10d | elapsed time per iteration (ms): %.1f |%s "
                 "learning rate: %.6E | global batch size: %5d | %s | loss scale: %.1f | grad norm: %s | "
                 "number of skipped iterations: %3d | number of nan iterations: %3d | tokens/s: %.0f%s",
                 iteration, cfg.optim.total_iters, consumed_samples, seconds * 1e3,
                 throughput, lr, batch, loss_text, loss_scale, norm, skipped, nans,
                 tokens / max(seconds, 1e-9), memory)

    def validation(self, iteration: int, consumed_samples: int, losses: dict[str, float]) -> None:
        """Megatron-LM's validation report (value and PPL = exp(min(20, loss)) per loss, between
        two rules of dashes), printed by the last stage's first rank."""
        if not self.is_logger:
            return
        text = f" validation loss at iteration {iteration} | " + "".join(
            f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(20.0, v)):.6E} | " for k, v in losses.items())
        if self.tensorboard is not None:
            for key, value in losses.items():
                self.tensorboard.add_scalar(f"{key} validation", value, iteration)
                self.tensorboard.add_scalar(f"{key} validation vs samples", value, consumed_samples)
        rule = "-" * (len(text) + 1)
        for line in (rule, text, rule):
            log.info("%s", line)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
