"""On 2 GPUs: --rampup-batch-size (4 -> 16 by 4 over 24 samples, micro batch 2: iterations of 2, 2, 4, 6,
then 8 microbatches) trains to the same losses under megatron-core's own 1F1B, the DPP runtime's eager
dpp-zb and --use-dpp alone (graphed dpp-zb: slots captured for 8 microbatches, the ramp's smaller
iterations replaying from fewer of them). Skipped with fewer than 2 GPUs. Run with::

    python -m pytest -m gpu tests/gpu/test_rampup_gpu.py -s
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.dist.launch import check_ok, launch

pytestmark = pytest.mark.gpu

RTOL = 1e-3  # fp32; megatron-core and the runtime sum the same microbatch losses in another order
ARGS = ["--device", "cuda", "--mock-data", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
        "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "1024", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24", "--train-samples", "96",
        "--pipeline-model-parallel-size", "2", "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--seed", "1234", "--transformer-impl", "local", "--dpp-timeout", "60"]
# 4 -> 16 by 4 over 24 samples (one increment every 8): batches 4, 4, 8, 12 (28 samples, past the ramp),
# then (96 - 28) // 16 = 4 of 16.
SIZES = [4, 4, 8, 12, 16, 16, 16, 16]


def _run(out: Path, *extra: str) -> tuple[dict[str, float], str]:
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    results = launch(["tests.dist.train_harness", "--out", str(out), "--", *ARGS, *extra], 2, timeout_s=400,
                     extra_env=env)
    check_ok(results)
    losses = {it: v["lm loss"] for it, v in json.loads((out / "losses_rank1.json").read_text()).items()}
    sizes = [int(s) for s in re.findall(r"global batch size:\s+(\d+)", results[1].output)]
    assert sizes == SIZES, results[1].output[-3000:]
    return losses, results[0].output + results[1].output


@pytest.mark.timeout(1200)
def test_rampup_dpp_graphed_and_eager_equal_megatron_1f1b_on_2_gpus(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    megatron, _ = _run(tmp_path / "1f1b")
    eager, _ = _run(tmp_path / "eager", "--use-dpp", "--dpp-eager", "--dpp-policy", "dpp-zb")
    graphed, output = _run(tmp_path / "graphed", "--use-dpp")
    assert "--rampup-batch-size: slots captured for the full batch" in output  # graphs on, and why
    replayed = [int(n) for n in re.findall(r"(\d+) training forward\(s\) replayed from CUDA graphs", output)]
    assert replayed and min(replayed) > 0, output[-3000:]
    assert sorted(megatron, key=int) == [str(i) for i in range(1, len(SIZES) + 1)]
    for it in megatron:
        print(it, megatron[it], eager[it], graphed[it])
        assert eager[it] == pytest.approx(megatron[it], rel=RTOL), ("eager dpp-zb", it)
        assert graphed[it] == pytest.approx(megatron[it], rel=RTOL), ("graphed dpp-zb", it)
