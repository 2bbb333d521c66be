"""On 4 GPUs: DPP training over NCCL links (ranks split 2+2 into "nodes") equals the same run over
same-node links. Skipped with fewer than 4 GPUs. Run on a 4-GPU machine with::

    python -m pytest -m gpu tests/gpu/test_dpp_nccl_split.py -s

MDPP_NODE_OF_RANK=0,0,1,1 makes ``--transport auto`` take the cross-node path (NCCL, headers on
TCP header lines) for edges 1-2 and 3-0, and the same-node GPU path for 0-1 and 2-3; the reference run keeps
all ranks on one node. Same seed and data; losses agree within bf16 noise (the DPP policy may
accumulate gradients in a different microbatch order when arrivals come in a different order).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags

pytestmark = pytest.mark.gpu

ITERS = 5
BF16_RTOL = 2e-2
GPT = [*model_flags(device="cuda", layers=8, hidden=1024, heads=16, seq=1024, max_position=1024, vocab=50257),
       "--micro-batch-size", "2", "--global-batch-size", "32",
       "--pipeline-model-parallel-size", "4", "--bf16", "--lr", "1e-4", "--train-iters", str(ITERS),
       "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--use-dpp",
       "--dpp-eager", "--transport", "auto", "--dpp-timeout", "60"]
EDGE = re.compile(r"(next|prev):(\d+)->(\d+):(\w+)")


def _run(out: Path, nodes: str | None) -> tuple[dict[str, float], set]:
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    if nodes:
        env["MDPP_NODE_OF_RANK"] = nodes
    results = launch(["tests.dist.train_harness", "--out", str(out), "--", *GPT], 4, timeout_s=400, extra_env=env)
    check_ok(results)
    edges = {m.groups() for r in results for m in EDGE.finditer(r.output)}
    losses = json.loads((out / "losses_rank3.json").read_text())
    return {it: v["lm loss"] for it, v in losses.items()}, edges


@pytest.mark.timeout(1000)
def test_dpp_over_nccl_links_equals_same_node_links_on_4_gpus(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 GPUs, {torch.cuda.device_count()} visible")
    split, split_edges = _run(tmp_path / "split", "0,0,1,1")
    same, _ = _run(tmp_path / "same", None)
    print("iteration  2+2 (nccl across)  one node")
    for it in sorted(same, key=int):
        print(it, split[it], same[it])
    cross = {(0, 3), (3, 0), (1, 2), (2, 1)}
    assert {e for e in split_edges if (int(e[1]), int(e[2])) in cross and e[3] == "nccl"} == {
        e for e in split_edges if (int(e[1]), int(e[2])) in cross}, split_edges
    assert sum(e[3] == "nccl" for e in split_edges) == 4, split_edges
    assert sorted(split, key=int) == [str(i) for i in range(1, ITERS + 1)]
    for it, value in same.items():
        assert split[it] == pytest.approx(value, rel=BF16_RTOL), f"iteration {it}"
