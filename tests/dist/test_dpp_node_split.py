"""DPP training over cross-node links equals the same run over same-node links (CPU, gloo, PP=4).

MDPP_NODE_OF_RANK=0,0,1,1 makes the four ranks of this host act as two nodes, so ``--transport auto``
puts edges 0-1 and 2-3 on shared memory and 1-2 and 3-0 on gloo (the cross-node path; NCCL on
GPUs). The reference run has all four ranks on one node (every edge shared memory). Same seed,
same data: the losses must agree (the transports move the same bytes; only the DPP policy's
arrival order may differ, which changes no per-microbatch result and only the summation order of
gradient accumulation).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags

LOSS_RTOL = 1e-5
ARGS = [*model_flags(model="gpt", layers=4), "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "4", "--use-dpp", "--transport", "auto", "--dpp-timeout", "120"]
EDGE = re.compile(r"(next|prev):(\d+)->(\d+):(\w+)")


def _run(out: Path, nodes: str | None) -> tuple[dict, set]:
    env = {"MDPP_NODE_OF_RANK": nodes} if nodes else {}
    results = launch(["tests.dist.train_harness", "--out", str(out), "--", *ARGS], 4, timeout_s=420, extra_env=env)
    check_ok(results)
    edges = {m.groups() for r in results for m in EDGE.finditer(r.output)}
    return json.loads((out / "losses_rank3.json").read_text()), edges


@pytest.mark.timeout(900)
def test_dpp_over_cross_node_links_equals_same_node_links(tmp_path: Path) -> None:
    split, split_edges = _run(tmp_path / "split", "0,0,1,1")
    same, same_edges = _run(tmp_path / "same", None)
    assert sorted(split) == sorted(same) == ["1", "2", "3"]
    for it, losses in same.items():
        for key, value in losses.items():
            assert split[it][key] == pytest.approx(value, rel=LOSS_RTOL), f"iteration {it} {key}"
    # Every rank logs its channels: within a "node" shared memory, across the halves gloo.
    cross = {(0, 3), (3, 0), (1, 2), (2, 1)}
    assert {(d, s, t, "gloo" if (int(s), int(t)) in cross else "shm") for d, s, t, _ in split_edges} == split_edges
    assert len(split_edges) == 8, split_edges
    assert {e[3] for e in same_edges} == {"shm"} and len(same_edges) == 8, same_edges
