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

    python3 scripts/layer_halves_probe.py
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
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainer.megatron.compat import apply_cpu_shims

    apply_cpu_shims()
    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=2, hidden_size=args.hidden_size, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec()
    parts = spec.submodules
    attention_half = dataclasses.replace(spec, submodules=dataclasses.replace(
        parts, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp))
    mlp_half = dataclasses.replace(spec, submodules=dataclasses.replace(
        parts, input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp))
    torch.manual_seed(0)
    whole, first, second = (build_module(s, config=config, layer_number=1) for s in (spec, attention_half, mlp_half))
    weights = whole.state_dict()
    for half in (first, second):
        half.load_state_dict({k: v for k, v in weights.items() if k in half.state_dict()}, strict=False)
    x = torch.randn(8, 2, args.hidden_size)
    mask = torch.tril(torch.ones(1, 1, 8, 8)).logical_not()

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
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
