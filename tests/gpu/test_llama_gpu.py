"""On 2 GPUs: a Llama-family GPT (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied output, no
linear biases) trains under megatron-core's own 1F1B and under the DPP runtime (dpp and dpp-zb) to the
same losses, from the same seed and data, with megatron-core's local layer spec; and with the
Transformer Engine spec where TE is installed (megatron-core's 1F1B: TE's RMSNorm and fused RoPE).
Skipped with fewer than 2 GPUs. Run with::

    python -m pytest -m gpu tests/gpu/test_llama_gpu.py -s
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags

pytestmark = pytest.mark.gpu

ITERS = 5
BF16_RTOL = 2e-2
LLAMA = [*model_flags(device="cuda", layers=8, hidden=1024, heads=16, seq=1024, max_position=1024, vocab=32000),
         "--group-query-attention", "--num-query-groups", "4", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--pipeline-model-parallel-size", "2", "--bf16", "--lr", "1e-4",
         "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
         "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--no-position-embedding",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--use-mcore-models", "--dpp-timeout", "60"]


def _losses(out: Path, *extra: str) -> dict[str, float]:
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    check_ok(launch(["tests.dist.train_harness", "--out", str(out), "--", *LLAMA, *extra], 2, timeout_s=400,
                    extra_env=env))
    return {it: v["lm loss"] for it, v in json.loads((out / "losses_rank1.json").read_text()).items()}


@pytest.mark.timeout(1500)
def test_llama_dpp_equals_megatron_1f1b_on_2_gpus(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    local = ["--transformer-impl", "local"]
    megatron = _losses(tmp_path / "1f1b", *local)
    runs = {policy: _losses(tmp_path / policy, *local, "--use-dpp", "--dpp-eager", "--dpp-policy", policy)
            for policy in ("dpp", "dpp-zb")}
    print("iteration  megatron-core 1F1B  " + "  ".join(runs))
    for it in sorted(megatron, key=int):
        print(it, megatron[it], *(runs[p][it] for p in runs))
        for policy, losses in runs.items():
            assert losses[it] == pytest.approx(megatron[it], rel=BF16_RTOL), (policy, it)
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return
    te = _losses(tmp_path / "te", "--transformer-impl", "transformer_engine")
    assert all(math.isfinite(v) for v in te.values()) and te[str(ITERS)] < te["1"], te
