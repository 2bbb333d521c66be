"""The attention half's share of one transformer layer's GPU time, measured on this GPU.

    python -m trainer.measure.layer_halves [--reps N] -- <trainer.train flags of a GPT model>

Builds one layer of the model the flags describe -- the trainer's own TransformerConfig and layer spec
(local or Transformer Engine, bf16 if asked), in one process, without pipeline or tensor parallelism
-- as the two halves ``--pipeline-stage-layers`` cuts it into (trainer/model/layer_parts.py), and
takes each half's forward and backward kernel time from the CUDA profiler (CUPTI), so host launch gaps
do not count: a stage under CUDA graphs runs its kernels back to back. Prints one JSON line:
``{"attention_share": ..., "forward_share": ..., "ms": {"attention": [F, B], "mlp": [F, B]}}``.

Why measure: FLOPs misjudge the split. On 4×H200-class GPUs megatron-core's local attention (unfused
softmax over seq² scores) takes about two thirds of a GPT layer at hidden 2048 and seq 1024, where
FLOPs give it about a third; the benchmark's ``--resplit auto`` asks this module before it places
half layers (trainer/bench/lines.py ``layer_attention_share``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings

from trainer.cli import OneLineParser


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.measure.layer_halves", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20, help="profiled calls per half (after 3 warm-up calls)")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER, help="-- then the trainer's flags")
    args = parser.parse_args(argv)
    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    print(json.dumps(measure(flags, args.reps)), flush=True)
    return 0


def measure(flags: list[str], reps: int = 20) -> dict:
    """The halves' kernel times of one layer of the model ``flags`` describe (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from trainer.config import parse_config
    from trainer.launch.topology import Topology
    from trainer.model.build import _layer_spec, params_dtype, transformer_config
    from trainer.model.layer_parts import part_spec
    from trainer.schedule.stage_parts import LayerPart

    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        raise SystemExit("trainer.measure.layer_halves: needs a GPU (it times kernels)")
    parsed = parse_config(flags, _world_size(flags))
    if parsed.model.model != "gpt":
        raise SystemExit(f"trainer.measure.layer_halves: measures GPT layers (got --model {parsed.model.model})")
    # One layer, one process: no pipeline, tensor or data parallelism, no split flags.
    cfg = dataclasses.replace(parsed, model=dataclasses.replace(parsed.model, num_layers=1),
                              parallel=dataclasses.replace(parsed.parallel, pipeline_model_parallel_size=1,
                                                           tensor_model_parallel_size=1, sequence_parallel=False,
                                                           decoder_first_pipeline_num_layers=None,
                                                           decoder_last_pipeline_num_layers=None,
                                                           pipeline_stage_layers=()))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1234)
        config = transformer_config(cfg, Topology(world_size=1, rank=0))
        spec, dtype = _layer_spec(cfg), params_dtype(cfg)
        s, b, h = cfg.model.seq_length, cfg.optim.micro_batch_size, cfg.model.hidden_size
        x = torch.randn(s, b, h, device="cuda", dtype=dtype)
        mask = torch.tril(torch.ones(1, 1, s, s, device="cuda")).logical_not()
        ms = {}
        for part in ("attention", "mlp"):
            layer = build_module(part_spec(spec, LayerPart(0, part)), config=config, layer_number=1)
            layer = layer.to(device="cuda", dtype=dtype)
            ms[part] = kernel_ms(lambda layer=layer: _output(layer(x.detach().requires_grad_(), attention_mask=mask)),
                                  reps)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    total = {part: sum(fb) for part, fb in ms.items()}
    return {"attention_share": total["attention"] / (total["attention"] + total["mlp"]),
            "forward_share": ms["attention"][0] / (ms["attention"][0] + ms["mlp"][0]),
            "ms": {part: [round(v, 4) for v in fb] for part, fb in ms.items()}}


def _world_size(flags: list[str]) -> int:
    """The world the flags' layout needs (PP x TP), so that their checks pass as in the real run."""
    def value(name: str) -> int:
        return int(flags[flags.index(name) + 1]) if name in flags else 1

    return value("--pipeline-model-parallel-size") * value("--tensor-model-parallel-size")


def _output(out):
    return out[0] if isinstance(out, tuple) else out


def kernel_ms(forward, reps: int) -> tuple[float, float]:
    """Kernel ms per call of ``forward()`` and of its backward (CUDA profiler, after 3 warm-up calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def profiled(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        return sum(e.self_device_time_total for e in prof.key_averages()) / reps / 1000.0

    def both() -> None:
        out = forward()
        out.backward(torch.ones_like(out))

    fwd = profiled(forward)
    return fwd, profiled(both) - fwd


if __name__ == "__main__":
    sys.exit(main())
