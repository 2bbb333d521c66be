"""Checks a Transformer Engine build on one GPU: it imports, the layers a dense GPT uses run forward and
backward in bf16 (te.Linear; te.TransformerLayer: LayerNorm, fused attention, GELU MLP), FP8 where the
card has it, and megatron-core's TE layer spec builds. Prints one line per check and exits 1 if a
required one failed."""
import sys
import time

import torch
import transformer_engine
import transformer_engine.pytorch as te

t0 = time.time()
failed = []


def check(name, fn, required=True):
    try:
        print(f"ok   {name}: {fn()}", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported, the required ones fail the run
        print(f"{'FAIL' if required else 'skip'} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if required:
            failed.append(name)


print("transformer_engine", transformer_engine.__version__, "torch", torch.__version__,
      "cudnn", te.get_cudnn_version(), "gpu", torch.cuda.get_device_name(0))
dev = "cuda:0"


def linear():
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    lin = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device=dev)
    y = lin(x)
    y.float().sum().backward()
    ref = x.detach().float() @ lin.weight.detach().float().t() + lin.bias.detach().float()
    err = (y.float() - ref).abs().max().item()
    assert err < 0.1, f"max |y - x W^T - b| = {err}"
    return f"bf16 fwd+bwd, max error vs torch {err:.3g}"


def layer():
    block = te.TransformerLayer(1024, 4096, 16, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                                attention_dropout=0.0, device=dev)
    h = torch.randn(512, 4, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    o = block(h, self_attn_mask_type="causal")
    o.float().sum().backward()
    assert torch.isfinite(h.grad).all()
    return f"bf16 fwd+bwd {tuple(o.shape)}"


def fp8():
    lin = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device=dev)
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    autocast = getattr(te, "autocast", None) or te.fp8_autocast
    with autocast(enabled=True):
        y = lin(x)
    y.float().sum().backward()
    return f"FP8 (default recipe) fwd+bwd, mean |y| {y.float().abs().mean().item():.3g}"


def megatron():
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    spec = get_gpt_layer_with_transformer_engine_spec()
    return f"megatron-core's TE spec builds ({type(spec).__name__})"


check("te.Linear", linear)
check("te.TransformerLayer", layer)
check("FP8 te.Linear", fp8, required=False)
check("megatron-core", megatron, required=False)
print(f"smoke {'FAILED: ' + ', '.join(failed) if failed else 'passed'} in {time.time() - t0:.1f} s")
sys.exit(1 if failed else 0)
