"""SIGUSR1/SIGTERM: ranks agree at the next iteration boundary, save, and exit 0 (Slurm requeues)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.dist.launch import start


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGUSR1])
def test_signal_to_one_rank_saves_on_all_ranks_and_exits_zero(signum, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = ["--device", "cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--pipeline-model-parallel-size", "2", "--use-dpp", "--train-iters", "100000", "--save", str(ckpt)]
    ranks = start(["trainer.train", *args], 2)
    deadline = time.monotonic() + 400
    # Rank 1 (last stage) logs iterations; signal only rank 0 once training is under way, so the
    # all-reduce of the flag is what makes rank 1 stop too.
    while "iteration        3/" not in ranks.output(1):
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.procs), ranks.output(1)[-3000:]
        time.sleep(0.2)
    ranks.procs[0].send_signal(signum)
    results = ranks.wait(120)
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:] + results[1].output[-3000:]
    match = re.search(r"saved checkpoint at iteration (\d+) on signal", results[0].output)
    assert match, results[0].output[-3000:]
    saved = int(match.group(1))
    assert saved >= 3
    assert (ckpt / "latest").read_text().strip() == str(saved)
    assert sorted(p.name for p in (ckpt / f"iter_{saved:07d}").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert not list(ckpt.glob("*.tmp"))
