"""``python -m trainer.bench.direct <trainer.train flags>``: megatron-core's own pipeline schedule driven
by a minimal loop, so the benchmark shows what the trainer adds on top of megatron-core's own loop.

Same model as the trainer (built by trainer.model.build from the same flags: megatron GPTModel,
Float16Module, megatron DDP), same megatron optimizer (``--optimizer``, fp32 main weights, grad
clip), same P2P settings and layer split. Left out on purpose, because they are the trainer's own
costs: the data path (here the mock microbatches are made on the GPU up front: one iteration's, reused,
or with --variable-seq-lengths every iteration's, so the lengths follow the trainer's),
the loss all-reduce/broadcast, the LR scheduler, logging, checkpoint and preemption checks.
Each iteration ends with ``torch.cuda.synchronize()`` so the host time is the GPU's.

It writes the same ``metrics_rank<R>.json`` as ``trainer.train --metrics-dir`` (losses only on the
last stage). CUDA only: its times are what it is for, and it builds its microbatches on the GPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


def _microbatches(cfg, device: torch.device, iteration: int = 0) -> list[dict[str, torch.Tensor]]:
    """The trainer's mock microbatches of ``iteration`` (DP = 1); with --variable-seq-lengths its
    documents, bucketed as the trainer does, so scenario (b) runs the very shapes the trainer runs."""
    from trainer.data.varlen import Bucketing, parse_length_distribution
    from trainer.model.batches import collate, mock_sample_source

    m, o, d = cfg.model, cfg.optim, cfg.data
    lengths = parse_length_distribution(d.mock_seq_len_dist)[0] if d.variable_seq_lengths else None
    bucketing = Bucketing(d.seq_length_divisible_by, m.seq_length) if d.variable_seq_lengths else None
    source = mock_sample_source("gpt", o.seed, m.seq_length, m.vocab_size, lengths)
    count = cfg.num_microbatches(dist.get_world_size())
    start = iteration * o.global_batch_size
    return [collate([source(start + i * o.micro_batch_size + j) for j in range(o.micro_batch_size)], "gpt",
                    device, bucketing) for i in range(count)]


def _mean_loss(losses: list[dict]) -> dict[str, float]:
    """Megatron-LM's reduction: a [sum, tokens] report (per-token loss) is sum / tokens, else a mean."""
    if not losses:
        return {}
    stacked = torch.stack([d["lm loss"].float().reshape(-1) for d in losses])
    if stacked.shape[1] == 2:
        return {"lm loss": float(stacked[:, 0].sum() / stacked[:, 1].sum().clamp(min=1))}
    return {"lm loss": float(stacked.mean())}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (1: not GPT on CUDA)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from trainer.config import parse_config, resolve_plan
    from trainer.launch.distributed import (
        build_topology,
        init_megatron_parallel,
        init_process_group,
        read_launch_env,
    )
    from trainer.measure.run_metrics import RunMeasurement
    from trainer.model import build_model_chunks, make_forward_step, wrap_ddp
    from trainer.model.build import params_dtype
    from trainer.session.optimizer_impl import select_torch_impl

    launch = read_launch_env()
    cfg = parse_config(argv, launch.world_size)
    if cfg.run.device != "cuda" or cfg.model.model != "gpt":
        print("trainer.bench.direct runs GPT on CUDA only", file=sys.stderr)
        return 1
    device = init_process_group(launch, "cuda")
    topo = build_topology(launch, cfg.parallel.tensor_model_parallel_size,
                          cfg.parallel.pipeline_model_parallel_size, cfg.virtual_pipeline)
    init_megatron_parallel(topo)
    from megatron.core import tensor_parallel

    plan = resolve_plan(cfg, launch.world_size)
    rng = plan.rng  # TE's tracker where megatron's graphs capture TE's layers
    torch.manual_seed(cfg.optim.seed + 100 * topo.pp_rank)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.optim.seed + 100 * topo.pp_rank, te_rng_tracker=rng.te_tracker,
                                                    use_cudagraphable_rng=rng.graph_safe)
    model = wrap_ddp(cfg, build_model_chunks(cfg, topo, cfg.model.vocab_size, rng))
    o = cfg.optim
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer=o.optimizer, lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad, bf16=o.bf16,
        fp16=o.fp16, params_dtype=params_dtype(cfg)), model)
    select_torch_impl(optimizer, plan.torch_optimizer_impl)  # the trainer's own step (trainer/session/build.py)
    config = model[0].config
    config.no_sync_func = model[0].no_sync if len(model) == 1 else [c.no_sync for c in model]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    schedule = get_forward_backward_func()
    # Fixed lengths: one iteration's microbatches serve every iteration (same shapes, same cost).
    # Variable lengths: every iteration's own (a few MB of token ids), made up front all the same.
    per_iteration = [_microbatches(cfg, device, it) for it in range(o.total_iters if cfg.data.variable_seq_lengths
                                                                     else 1)]
    layers = resolve_plan(cfg, launch.world_size).layers.per_stage
    measure = RunMeasurement(cfg, topo, "direct megatron-core", len(per_iteration[0]), layers)
    forward_step = measure.wrap_forward_step(make_forward_step("gpt", per_token_loss=cfg.data.variable_seq_lengths),
                                             model)
    for step in range(o.total_iters):
        measure.before_step(step)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batches = per_iteration[step % len(per_iteration)]
        losses = schedule(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in model],
                          model=model, num_microbatches=len(batches), seq_length=cfg.model.seq_length,
                          micro_batch_size=o.micro_batch_size, decoder_seq_length=cfg.model.seq_length,
                          forward_only=False)
        optimizer.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        measure.after_step(step, seconds, _mean_loss(losses))
    measure.write()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
