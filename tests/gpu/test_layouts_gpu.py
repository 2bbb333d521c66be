"""On 4 GPUs, each layout of the `layouts` benchmark beyond GPT PP=4 (which tests/dist/test_train_gpu.py
covers): ``--use-dpp`` alone (its default, graphed dpp-zb on each) trains to megatron-core's own 1F1B
losses of the same layout for 10 iterations, from the same seed, within bf16 noise -- GPT PP=2 x TP=2 with
--sequence-parallel (the TP collectives captured in the slot graphs), GPT PP=2 x DP=2 with
--overlap-grad-reduce --use-distributed-optimizer (the runtime starting each chunk's reduce-scatter), and
BERT PP=4 (the layouts benchmark's bert16-h2048). The first log line must say what the default chose.
Skipped below 4 GPUs::

    pytest -m gpu tests/gpu/test_layouts_gpu.py -s
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags

pytestmark = pytest.mark.gpu

ITERS = 10
BF16_RTOL = 2e-2
"""As tests/dist/test_train_gpu.py: bf16 rounding of the two schedules' microbatch orders."""
COMMON = ["--bf16", "--lr", "1e-4", "--lr-warmup-iters", "2", "--train-iters", str(ITERS), "--hidden-dropout", "0",
          "--attention-dropout", "0", "--seed", "1234", "--log-interval", "1", "--optimizer", "adam"]
GPT = [*model_flags(device="cuda", layers=16, hidden=2048, heads=16, seq=1024, max_position=1024, vocab=50257),
       "--micro-batch-size", "2", "--global-batch-size", "64", *COMMON]
BERT = [*model_flags(device="cuda", model="bert", layers=16, hidden=2048, heads=16, seq=512, max_position=512,
                     vocab=30522), "--micro-batch-size", "4", "--global-batch-size", "128", *COMMON]
LAYOUTS = {
    "gpt-pp2-tp2-sp": [*GPT, "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel"],
    "gpt-pp2-dp2-overlap-distopt": [*GPT, "--pipeline-model-parallel-size", "2", "--overlap-grad-reduce",
                                    "--use-distributed-optimizer"],
    "bert-pp4": [*BERT, "--pipeline-model-parallel-size", "4"],
}
LAST_RANK = 3
"""A rank of the last stage on every layout here (megatron-core orders ranks TP fastest, then DP, then PP)."""


def _run(out: Path, layout: str, extra: list[str]) -> tuple[dict, str]:
    results = launch(["tests.dist.train_harness", "--out", str(out), "--", *LAYOUTS[layout], *extra], 4,
                     timeout_s=560, extra_env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")})
    check_ok(results)
    return json.loads((out / f"losses_rank{LAST_RANK}.json").read_text()), results[0].output


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_use_dpp_alone_trains_to_megatron_1f1b_losses_on_each_layout(tmp_path: Path, layout: str) -> None:
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    megatron, _ = _run(tmp_path / "1f1b", layout, ["--no-batch-p2p-sync", "--run-name", f"{layout}-1f1b"])
    dpp, log = _run(tmp_path / "dpp", layout, ["--use-dpp", "--run-name", f"{layout}-dpp"])
    assert "schedule dpp-zb (--dpp-policy auto" in log and "graphs: --use-dpp's default" in log, log[-3000:]
    assert sorted(dpp, key=int) == sorted(megatron, key=int) == [str(i) for i in range(1, ITERS + 1)]
    print(f"{layout}: iteration, --use-dpp, megatron-core 1F1B")
    for it in sorted(megatron, key=int):
        print(it, dpp[it], megatron[it])
        assert set(dpp[it]) == set(megatron[it]), it
        for key, value in megatron[it].items():
            assert dpp[it][key] == pytest.approx(value, rel=BF16_RTOL), f"{layout}, iteration {it}, {key}"
