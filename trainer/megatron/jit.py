"""Import megatron-core with its ``torch.compile`` fusions compiled on first call, not at import.

megatron-core decorates its fused kernels (bias-GeLU, bias-SwiGLU, bias-dropout-add, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2. Calling ``torch.compile``
on a function compiles nothing yet, but it imports TorchDynamo and Inductor: about 3 s of CPU per
process on a 2-core machine, paid by every rank of every run, although a CPU run switches those
fusions off (trainer/model/build.py) and never calls them. :func:`import_megatron_core` imports
megatron-core once with ``torch.compile`` swapped for :func:`compile_on_first_call`, which keeps the
function and hands it to the real ``torch.compile`` (same options) the first time it is called. A GPU
run with fusions on compiles the same functions with the same options; only the import moves to the
first call (which ``torch.compile`` compiles at anyway). ``megatron.core.jit.jit_fuser`` keeps the
deferring decorator, so modules megatron-core imports later (layer specs) defer too.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile_on_first_call", "import_megatron_core"]

_torch_compile = torch.compile  # the real one, whatever import_megatron_core swaps in meanwhile


def compile_on_first_call(model: Any = None, **options: Any) -> Any:
    """``torch.compile``'s signature; a plain function is compiled (with ``options``) at its first call.

    Modules and anything else go straight to ``torch.compile``, whose wrappers they need at once."""
    if model is None:  # used as @torch.compile(**options)
        return functools.partial(compile_on_first_call, **options)
    if not callable(model) or isinstance(model, torch.nn.Module):
        return _torch_compile(model, **options)
    compiled: Callable | None = None

    @functools.wraps(model)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = _torch_compile(model, **options)
        return compiled(*args, **kwargs)

    return call


def import_megatron_core() -> None:
    """Import megatron-core (if not yet imported) with its fusions' compilation deferred; idempotent."""
    if "megatron.core.jit" in sys.modules:
        return
    torch.compile = compile_on_first_call
    try:
        import megatron.core  # noqa: F401  (megatron.core.jit reads torch.compile here)
    finally:
        torch.compile = _torch_compile
