"""trainer.session.optimizer_impl: --torch-optimizer-impl fused makes torch's own AdamW / SGD inside
megatron-core's optimizer step with torch's fused kernels (no temporaries the size of all parameters): the
step is then exactly the one torch's fused=True optimizer takes, and can switch between steps (a resume);
other optimizers (TE's or Apex's fused ones) are left alone. torch's fused step runs on the CPU too, so the CPU
checks the real kernels."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, parse_config, resolve_plan
from trainer.config.optim import resolve_torch_optimizer_impl
from trainer.session.optimizer_impl import pending_state_bytes, select_torch_impl, torch_optimizers


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((64, 32), (32,), (7, 5))]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


class _Wrapped:
    """Stands in for megatron-core's optimizer: the torch one is its ``optimizer``; chained ones list them."""

    def __init__(self, inner) -> None:
        self.optimizer = inner


@pytest.mark.parametrize("make", [lambda ps, **k: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **k),
                                  lambda ps, **k: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, **k)],
                         ids=["adamw", "sgd"])
def test_the_switched_step_is_torch_s_fused_step(make) -> None:
    switched_params, fused_params, foreach_params = _params(), _params(), _params()
    switched = make(switched_params)
    assert select_torch_impl(_Wrapped(switched), "fused") == 1 and switched.param_groups[0]["fused"]
    got = _train(switched, switched_params)
    want = _train(make(fused_params, fused=True), fused_params)
    default = _train(make(foreach_params, foreach=True), foreach_params)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(torch.allclose(g, d, rtol=1e-5, atol=1e-6) for g, d in zip(got, default, strict=True))  # the same maths


def test_foreach_leaves_the_optimizer_as_built_and_the_step_can_switch_between_steps() -> None:
    """Switching after state exists moves each step count to where the new step keeps it, and the maths goes
    on unchanged: a checkpoint saved with either implementation resumes with either."""
    params, ref_params = _params(), _params()
    opt, ref = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    assert select_torch_impl(_Wrapped(opt), "foreach") == 0
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["foreach"] is None  # as megatron builds it
    _train(opt, params, steps=2)
    assert select_torch_impl(_Wrapped(opt), "fused") == 1
    assert all(s["step"].dtype == torch.float32 and s["step"].device == p.device for p, s in opt.state.items())
    _train(ref, ref_params, steps=2)
    got, want = _train(opt, params, steps=2), _train(ref, ref_params, steps=2)
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want, strict=True))
    assert all(float(s["step"]) == 4 for s in opt.state.values())
    assert select_torch_impl(_Wrapped(opt), "foreach") == 0 and opt.param_groups[0]["fused"] is None
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())
    with pytest.raises(ValueError, match="'apex': foreach or fused"):
        select_torch_impl(_Wrapped(opt), "apex")


def test_chained_optimizers_are_each_switched_and_foreign_ones_left_alone() -> None:
    class Foreign(torch.optim.Optimizer):  # e.g. Transformer Engine's FusedAdam: not torch's own
        def __init__(self, params) -> None:
            super().__init__(params, {"lr": 1e-2})

    a, b, c = torch.optim.AdamW(_params(), lr=1e-2), torch.optim.SGD(_params(), lr=1e-2), Foreign(_params())
    chained = type("Chained", (), {"chained_optimizers": [_Wrapped(a), _Wrapped(b), _Wrapped(c)]})()
    assert torch_optimizers(chained) == [a, b, c]
    assert select_torch_impl(chained, "fused") == 2
    assert a.param_groups[0]["fused"] and b.param_groups[0]["fused"] and "fused" not in c.param_groups[0]


def test_auto_is_fused_on_cuda_and_foreach_on_the_cpu_and_a_resume_is_allowed() -> None:
    base = ["--mock-data", "--num-layers", "2", "--device", "cpu"]
    assert parse_config(base, world_size=1).optim.torch_optimizer_impl == "auto"
    assert resolve_plan(parse_config(base, world_size=1), 1).torch_optimizer_impl == "foreach"
    assert resolve_torch_optimizer_impl("auto", "cuda")[0] == "fused"
    assert resolve_torch_optimizer_impl("foreach", "cuda") == ("foreach", "--torch-optimizer-impl foreach")
    plan = resolve_plan(parse_config([*base, "--torch-optimizer-impl", "fused", "--load", "ckpt"], world_size=1), 1)
    assert plan.torch_optimizer_impl == "fused"
    with pytest.raises(ConfigError, match="--torch-optimizer-impl='apex' must be one of auto, foreach, fused"):
        parse_config([*base, "--torch-optimizer-impl", "apex"], world_size=1)


def test_the_state_a_first_step_will_allocate_is_counted_until_it_exists() -> None:
    """What --dpp-held-cap fit adds to the memory the graph capture measures (trainer/pipeline/stage_graphs.py)."""
    numel = sum(p.numel() for p in _params())  # 64 x 32 + 32 + 7 x 5, fp32
    adam, sgd = torch.optim.AdamW(_params(), lr=1e-2), torch.optim.SGD(_params(), lr=1e-2, momentum=0.9)
    plain_sgd = torch.optim.SGD(_params(), lr=1e-2)
    chained = type("Chained", (), {"chained_optimizers": [_Wrapped(adam), _Wrapped(sgd), _Wrapped(plain_sgd)]})()
    assert pending_state_bytes(chained) == (2 + 1 + 0) * 4 * numel
    _train(adam, adam.param_groups[0]["params"], steps=1)  # its state exists now (as after a checkpoint load)
    assert pending_state_bytes(chained) == 4 * numel
