"""trainer/megatron/jit.py: megatron-core's torch.compile fusions are compiled at their first call, so a
rank that never calls them (every CPU run) imports no TorchDynamo/Inductor for them (~3 s of CPU each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from trainer.megatron import jit

REPO = Path(__file__).resolve().parents[2]


def test_a_function_is_compiled_once_at_its_first_call_with_the_options_given(monkeypatch):
    compiled = []

    def fake_compile(fn, **options):  # stands in for torch.compile: records, returns a distinct callable
        compiled.append(options)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    monkeypatch.setattr(jit, "_torch_compile", fake_compile)

    @jit.compile_on_first_call(dynamic=False)
    def double(x, scale=1):
        return 2 * x * scale

    assert compiled == [] and double.__name__ == "double"
    assert double(3, scale=2) == ("compiled", 12)
    assert double(1) == ("compiled", 2)
    assert compiled == [{"dynamic": False}]  # once, with the decorator's options


def test_modules_go_to_torch_compile_at_once(monkeypatch):
    seen = []
    monkeypatch.setattr(jit, "_torch_compile", lambda model, **options: seen.append(model) or model)
    layer = torch.nn.Linear(2, 2)
    assert jit.compile_on_first_call(layer) is layer and seen == [layer]


def test_megatron_core_imports_without_inductor_and_keeps_deferring():
    code = ("import sys, torch\n"
            "from trainer.megatron.jit import compile_on_first_call, import_megatron_core\n"
            "real = torch.compile\n"
            "import_megatron_core()\n"
            "import megatron.core.jit, megatron.core.fusions.fused_bias_gelu\n"
            "from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec\n"
            "assert torch.compile is real, 'torch.compile left swapped'\n"
            "assert megatron.core.jit.jit_fuser is compile_on_first_call, megatron.core.jit.jit_fuser\n"
            "assert 'torch._inductor' not in sys.modules, 'Inductor imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
