"""Checkpoints on CUDA (megatron-core 0.19 and Transformer Engine on the GPU machines; the CPU tests run
0.16 with torch's Adam): save at 3 of 6 iterations, resume, iterations 4-6 equal the straight run's
within the CPU tests' tolerance -- under the same layout (PP=2, DPP) with the plain and the
distributed optimizer, and under another one (PP=2 -> one rank). On a one-GPU machine the two ranks
share the GPU (--distributed-backend gloo). fp32, dropout 0. The straight run steps with torch's foreach
step, the resumed ones with the default (fused on CUDA, where neither TE nor Apex is installed): the
restored step counts move from the CPU to the GPU.

    python -m pytest -m gpu tests/gpu/test_checkpoint_gpu.py -s
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.dist.checkpoints import TRACKER, assert_megatron_checkpoint
from tests.dist.launch import check_ok, launch
from tests.model_flags import GPU_SMALL, model_flags

pytestmark = pytest.mark.gpu

LOSS_RTOL = 1e-5
GPT = [*model_flags(**GPU_SMALL), "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
       "--lr-warmup-iters", "2", "--lr-decay-iters", "8", "--train-iters", "6", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--seed", "1234", "--dpp-timeout", "60", "--log-interval", "1"]
PP2 = ["--pipeline-model-parallel-size", "2", "--use-dpp", "--dpp-eager"]


def _train(out: Path, world: int, *extra: str) -> tuple[dict[int, float], str]:
    args = [*GPT, *extra]
    if world > torch.cuda.device_count():
        args += ["--distributed-backend", "gloo"]
    results = launch(["tests.dist.train_harness", "--out", str(out), "--", *args], world, timeout_s=400)
    check_ok(results)
    losses = json.loads((out / "losses_rank0.json").read_text())
    return {int(it): v["lm loss"] for it, v in losses.items()}, results[0].output


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", [(), ("--use-distributed-optimizer",)], ids=["plain", "distributed"])
def test_resume_on_cuda_same_and_other_layout(tmp_path: Path, optimizer: tuple[str, ...]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    ckpt = tmp_path / "ckpt"
    straight, _ = _train(tmp_path / "straight", 2, *PP2, *optimizer, "--save", str(ckpt), "--save-interval", "3",
                         "--torch-optimizer-impl", "foreach")
    assert_megatron_checkpoint(ckpt, 6)
    (ckpt / TRACKER).write_text("3\n")
    for name, world, layout in (("same", 2, PP2), ("one-rank", 1, [])):
        resumed, output = _train(tmp_path / name, world, *layout, *optimizer, "--load", str(ckpt))
        assert "resuming at iteration 3" in output and sorted(resumed) == [4, 5, 6], output[-3000:]
        torch_fallback = not any(importlib.util.find_spec(m) for m in ("transformer_engine", "apex"))
        assert ("the restored state steps with torch's fused step" in output) == torch_fallback, output[-3000:]
        print(name, {it: (straight[it], resumed[it]) for it in resumed})
        for it in (4, 5, 6):
            assert resumed[it] == pytest.approx(straight[it], rel=LOSS_RTOL), (name, it)
