"""Can a pipeline stage boundary fall inside a transformer layer? A CPU probe of megatron-core.

The balanced-limit goal of the schedule benchmark is out of reach with whole layers per stage
(docs/schedules.md, "Is ≤ 1.12× reachable?"); a boundary between a layer's attention and its MLP
would reach it. This builds one megatron-core GPT layer (local spec) whole and as two
TransformerLayers from the same spec -- the attention half with ``IdentityOp`` for the pre-MLP norm
and the MLP (``IdentityFuncOp`` for its bias-dropout-add), the MLP half with ``IdentityOp`` for the
input norm and the attention -- loads the whole layer's weights into the halves, and prints: which
parameters each half holds, the largest difference between the whole layer's output and the halves'
composed, and the dist-checkpointing keys each half gives (the same as the whole layer's, split
between them). On megatron-core 0.16.1: disjoint parameter sets covering the layer, difference 0.0,
megatron's own keys.

With ``--time`` on a GPU it also times each part's forward and backward (kernel time, bf16, the
benchmark model's sizes by default): the attention half's share of a layer, which the half-split
cost model's FLOPs estimate can be checked against (trainer.measure.layer_halves measures it
for any GPT the trainer's flags describe).

    python3 scripts/layer_halves_probe.py
    python3 scripts/layer_halves_probe.py --time --hidden-size 2048 --heads 16 --seq-length 1024 --micro-batch-size 2
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

import torch
import torch.distributed as dist

from trainer.cli import OneLineParser


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python scripts/layer_halves_probe.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--time", action="store_true", help="on CUDA: time each part's forward and backward (bf16)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.time and not cuda:
        parser.error("--time needs a GPU")
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainer.measure.layer_halves import kernel_ms
    from trainer.megatron.compat import apply_cpu_shims

    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    else:
        apply_cpu_shims()
    parallel_state.initialize_model_parallel()
    if cuda:
        model_parallel_cuda_manual_seed(0)
    dtype = torch.bfloat16 if args.time else torch.float32
    config = TransformerConfig(num_layers=2, hidden_size=args.hidden_size, num_attention_heads=args.heads,
                               use_cpu_initialization=not cuda, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=dtype, bf16=args.time)
    spec = get_gpt_layer_local_spec()
    parts = spec.submodules
    attention_half = dataclasses.replace(spec, submodules=dataclasses.replace(
        parts, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp))
    mlp_half = dataclasses.replace(spec, submodules=dataclasses.replace(
        parts, input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp))
    torch.manual_seed(0)
    device = torch.device("cuda" if cuda else "cpu")
    whole, first, second = (build_module(s, config=config, layer_number=1).to(device=device, dtype=dtype)
                            for s in (spec, attention_half, mlp_half))
    weights = whole.state_dict()
    for half in (first, second):
        half.load_state_dict({k: v for k, v in weights.items() if k in half.state_dict()}, strict=False)
    s_len = args.seq_length
    x = torch.randn(s_len, args.micro_batch_size, args.hidden_size, device=device, dtype=dtype)
    mask = torch.tril(torch.ones(1, 1, s_len, s_len, device=device)).logical_not()

    def run(layer, hidden):
        out = layer(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    print("megatron-core", megatron.core.__version__)
    for name, half in (("attention half", first), ("MLP half", second)):
        params = sorted(k for k in half.state_dict() if not k.endswith("_extra_state"))
        keys = sorted({v.key for v in half.sharded_state_dict(prefix="decoder.layers.0.").values() if hasattr(v, "key")})
        print(f"{name}: parameters {params}\n  checkpoint keys {keys}")
    covered = set(first.state_dict()) | set(second.state_dict())
    print("parameters of the whole layer in neither half:", sorted(set(weights) - covered) or "none")
    with torch.no_grad():
        print("max |whole layer - halves composed|:", (run(whole, x) - run(second, run(first, x))).abs().max().item())
    if args.time:
        times = {name: kernel_ms(lambda layer=layer: run(layer, x.detach().requires_grad_()), args.reps)
                 for name, layer in (("whole layer", whole), ("attention half", first), ("MLP half", second))}
        for name, (fwd, bwd) in times.items():
            print(f"{name}: forward {fwd:.3f} ms, backward {bwd:.3f} ms, total {fwd + bwd:.3f} ms")
        attn, mlp = (sum(times[k]) for k in ("attention half", "MLP half"))
        print(f"attention half's share of the two halves: {attn / (attn + mlp):.3f} "
              f"(forward {times['attention half'][0] / (times['attention half'][0] + times['MLP half'][0]):.3f})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
