"""--record-memory-history on CUDA (Megatron-LM's flag): two ranks train graphed dpp-zb (PP=2, --use-dpp's
default) and each writes its own allocator snapshot, which trainer.profiling.memory_summary reads: the
slot graphs' private pools hold reserved memory, the history has a peak at least the snapshot's total,
and the summary command names every rank's file. On a one-GPU machine the two ranks share the GPU (gloo).

    python -m pytest -m gpu tests/gpu/test_memory_history_gpu.py -s
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from tests.dist.launch import check_ok, launch
from tests.model_flags import GPU_SMALL, model_flags
from trainer.profiling.memory_summary import main as summarize
from trainer.profiling.memory_summary import peak, pools

pytestmark = pytest.mark.gpu

GPT = [*model_flags(**GPU_SMALL), "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
       "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
       "--dpp-timeout", "60", "--log-interval", "2", "--pipeline-model-parallel-size", "2", "--use-dpp"]


@pytest.mark.timeout(600)
def test_every_rank_writes_a_snapshot_that_the_summary_reads(tmp_path: Path, capsys) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    args = [*GPT, "--record-memory-history", "--memory-snapshot-path", str(tmp_path / "snaps" / "mem.pickle")]
    if torch.cuda.device_count() < 2:
        args += ["--distributed-backend", "gloo"]
    results = launch(["tests.dist.train_harness", "--out", str(tmp_path / "run"), "--", *args], 2, timeout_s=400)
    check_ok(results)
    files = sorted((tmp_path / "snaps").iterdir())
    assert [f.name for f in files] == ["mem_rank0.pickle", "mem_rank1.pickle"], files  # no .partial left
    for f in files:
        snapshot = pickle.loads(f.read_bytes())
        by_pool = pools(snapshot)
        graphs = {name: v for name, v in by_pool.items() if "CUDA graphs" in name}
        assert graphs and sum(r for r, _, _ in graphs.values()) > 0, by_pool  # the slot graphs' pools
        p = peak(snapshot)
        assert p is not None and p.reserved >= sum(r for r, _, _ in by_pool.values()), (f, p)
    assert summarize([str(f) for f in files]) == 0
    out = capsys.readouterr().out
    assert all(f"== {f}" in out for f in files) and out.count("peak reserved over the recorded history") == 2
    print(out)
