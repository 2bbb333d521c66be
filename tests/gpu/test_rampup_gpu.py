"""On 2 GPUs: --rampup-batch-size (4 -> 16 by 4 over 24 samples, micro batch 2: iterations of 2, 2, 4, 6,
then 8 microbatches) trains to the same losses under megatron-core's own 1F1B, the DPP runtime's eager
dpp-zb and --use-dpp alone (graphed dpp-zb: slots captured for 8 microbatches, the ramp's smaller
iterations replaying from fewer of them). On 4 GPUs the same with PP=4 and a ramp that starts below the
pipeline depth (2 -> 8 microbatches of 1 sample: 2, 2, 4, 6, then 8), graphed dpp and dpp-zb included.
Skipped with fewer GPUs. Run with::

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


# PP=4, micro batch 1: 2 -> 8 by 2 over 12 samples (one increment every 4): batches 2, 2, 4, 6 (14 samples,
# past the ramp), then (38 - 14) // 8 = 3 of 8.
BELOW_PP = [*ARGS[:ARGS.index("--micro-batch-size")], "--micro-batch-size", "1", "--global-batch-size", "8",
            "--rampup-batch-size", "2", "2", "12", "--train-samples", "38", "--pipeline-model-parallel-size", "4",
            *ARGS[ARGS.index("--lr"):]]
SIZES_BELOW_PP = [2, 2, 4, 6, 8, 8, 8]


def _run(out: Path, *extra: str, args: list[str] = ARGS, world: int = 2,
         sizes: list[int] = SIZES) -> tuple[dict[str, float], str]:
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    results = launch(["tests.dist.train_harness", "--out", str(out), "--", *args, *extra], world, timeout_s=400,
                     extra_env=env)
    check_ok(results)
    last = world - 1
    losses = {it: v["lm loss"] for it, v in json.loads((out / f"losses_rank{last}.json").read_text()).items()}
    logged = [int(s) for s in re.findall(r"global batch size:\s+(\d+)", results[last].output)]
    assert logged == sizes, results[last].output[-3000:]
    return losses, "".join(r.output for r in results)


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


@pytest.mark.timeout(1800)
def test_ramp_below_the_pipeline_depth_dpp_graphed_and_eager_equal_megatron_1f1b_on_4_gpus(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 GPUs, {torch.cuda.device_count()} visible")
    run = {"args": BELOW_PP, "world": 4, "sizes": SIZES_BELOW_PP}
    megatron, _ = _run(tmp_path / "1f1b", **run)
    runs = {"eager dpp-zb": _run(tmp_path / "eager", "--use-dpp", "--dpp-eager", "--dpp-policy", "dpp-zb", **run),
            "graphed dpp-zb": _run(tmp_path / "graphed-zb", "--use-dpp", **run),
            "graphed dpp": _run(tmp_path / "graphed-dpp", "--use-dpp", "--dpp-policy", "dpp", **run)}
    assert sorted(megatron, key=int) == [str(i) for i in range(1, len(SIZES_BELOW_PP) + 1)]
    for name, (losses, output) in runs.items():
        if name.startswith("graphed"):
            assert "--rampup-batch-size: slots captured for the full batch" in output
            replayed = [int(n) for n in re.findall(r"(\d+) training forward\(s\) replayed from CUDA graphs", output)]
            assert replayed and min(replayed) > 0, output[-3000:]
        for it in megatron:
            assert losses[it] == pytest.approx(megatron[it], rel=RTOL), (name, it)
