"""Machine-readable per-rank results of a training run (``--metrics-dir``), and the measurement hooks
behind them: GPU busy time over a window of iterations and injected stalls.

Each rank writes ``metrics_rank<R>.json`` when the run closes::

    {"rank", "stage", "world_size", "schedule", "run_name", "device", "layers_per_stage",
     "num_microbatches", "tokens_per_iteration",
     "iterations": [{"iteration": 1, "ms": 512.3, "losses": {"lm loss": 10.9}, "gpu_profiled": false,
                     "global_batch_size": 16, "num_microbatches": 8, "tokens": 16384, "tokens_per_s": 31981.3}, ...],
     "peak_memory_bytes": ..., "peak_reserved_bytes": ..., "gpu_busy": {...} | null, "stalls": {...} | null, "versions": {...}}

``num_microbatches`` and ``tokens_per_iteration`` (global batch x --seq-length) are those of
--global-batch-size; each iteration's record carries its own batch, microbatches, tokens and tokens per
second, which differ during a --rampup-batch-size ramp (throughput is that iteration's tokens over its ms).
``ms`` is the host wall time of the whole step (zero grads, schedule, optimizer, loss all-reduce,
which waits for the GPU), the figure the log line prints. Iterations with ``gpu_profiled`` ran under
the profiler (trainer/profiling/gpu_busy.py) and a benchmark should leave them out of its timings.
Nothing here is collective: a rank that fails still leaves the others' files.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig
from trainer.launch.topology import Topology

METRICS_FILE_FORMAT = "metrics_rank{rank:05d}.json"


def metrics_file_name(rank: int) -> str:
    return METRICS_FILE_FORMAT.format(rank=rank)


def versions(device_type: str) -> dict[str, str]:
    """torch, megatron-core, NCCL, CUDA, Python and the card: what a benchmark report must name."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import megatron.core

        out["megatron_core"] = megatron.core.__version__
    except Exception:  # report what is there; never fail a run over a version string
        out["megatron_core"] = "?"
    if device_type == "cuda" and torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["device_name"] = torch.cuda.get_device_name()
    else:
        out["device_name"] = platform.processor() or platform.machine()
    return out


@dataclass
class RunMeasurement:
    """Owns this rank's metrics records, the GPU busy window and the stall injector."""

    cfg: TrainConfig
    topology: Topology
    schedule: str
    """Label of the schedule this rank runs (the run plan's ``schedule.label``, e.g. "megatron-core 1f1b",
    "runtime dpp-zb")."""
    num_microbatches: int
    layers_per_stage: tuple[float, ...]
    """The run plan's layer split (``layers.per_stage``): the aggregation fits layer costs with it.
    Whole counts are ints; --pipeline-stage-layers may give halves (4.5), written as such."""
    records: list[dict[str, Any]] = field(default_factory=list)
    gpu_busy: Any = None
    stalls: Any = None

    def __post_init__(self) -> None:
        run = self.cfg.run
        if run.metrics_dir and run.device == "cuda" and run.gpu_busy_iters:
            from trainer.profiling.gpu_busy import GpuBusyMeter

            last = self.cfg.optim.total_iters - 1
            self.gpu_busy = GpuBusyMeter(first=max(0, last - run.gpu_busy_iters + 1), last=last)

    def wrap_forward_step(self, forward_step: Callable, chunks: list) -> Callable:
        """The forward step every schedule calls, delayed per --inject-stalls on the named rank."""
        if self.cfg.run.inject_stalls is None:
            return forward_step
        from trainer.schedule.stall_injection import make_stall_injector, parse_stall_spec

        spec = parse_stall_spec(self.cfg.run.inject_stalls)
        if spec.rank != self.topology.rank:
            return forward_step
        self.stalls = make_stall_injector(spec, chunks, self.cfg.run.device)
        return self.stalls.wrap(forward_step)

    def before_step(self, step: int) -> None:
        if self.stalls is not None:
            self.stalls.set_iteration(step)
        if self.gpu_busy is not None:
            self.gpu_busy.before_step(step)

    def after_step(self, step: int, seconds: float, losses: dict[str, float],
                   global_batch_size: int | None = None) -> None:
        """``global_batch_size``: this iteration's (--rampup-batch-size changes it), default --global-batch-size."""
        if self.gpu_busy is not None:
            self.gpu_busy.after_step(step)
        o = self.cfg.optim
        batch = global_batch_size or o.global_batch_size
        tokens = batch * self.cfg.model.seq_length
        self.records.append({"iteration": step + 1, "ms": seconds * 1e3, "losses": losses,
                             "gpu_profiled": self.gpu_busy is not None and self.gpu_busy.covers(step),
                             "global_batch_size": batch,
                             # the full batch's count scaled: every size of a ramp divides into microbatches
                             "num_microbatches": self.num_microbatches * batch // o.global_batch_size,
                             "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9)})

    def write(self) -> Path | None:
        """Write this rank's file (when --metrics-dir is set); returns its path."""
        run, t = self.cfg.run, self.topology
        if not run.metrics_dir:
            return None
        import torch

        from trainer.profiling.tracer import write_json_atomic

        on_cuda = run.device == "cuda" and torch.cuda.is_available()
        document = {
            "rank": t.rank, "stage": t.pp_rank, "tp_rank": t.tp_rank, "dp_rank": t.dp_rank,
            "world_size": t.world_size, "pipeline_parallel": t.pipeline_parallel,
            "virtual_pipeline": t.virtual_pipeline, "schedule": self.schedule, "run_name": run.run_name,
            "device": run.device,
            "layers_per_stage": list(self.layers_per_stage),
            "num_microbatches": self.num_microbatches,
            "tokens_per_iteration": self.cfg.optim.global_batch_size * self.cfg.model.seq_length,
            "iterations": self.records,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if on_cuda else None,
            # What the process holds on the GPU (allocated + cached + CUDA-graph pools). A graph replays
            # into its pool's memory while no tensor is allocated there, so for graphed runs the allocated
            # peak undercounts; this is the figure to compare across schedules (it decides OOM).
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if on_cuda else None,
            "gpu_busy": self.gpu_busy.result if self.gpu_busy is not None and self.gpu_busy.result else None,
            "stalls": None if self.stalls is None else {
                "spec": run.inject_stalls, "delayed_ops": len(self.stalls.delayed),
                "delayed": self.stalls.delayed[:200]},
            "versions": versions(run.device),
        }
        path = Path(run.metrics_dir) / metrics_file_name(t.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, document)
        return path
