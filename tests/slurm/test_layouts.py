"""Layouts with several ranks per node start on the real cluster.

Before: the training allocation asked for one task per node, and `srun --ntasks=2` on one node
was refused ("More processors requested than permitted"): `submit gpt --nodes 1` always failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.corpus import small_corpus

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_two_ranks_on_one_node_train(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl", 200)
    done = subprocess.run([sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "1", "--train-iters", "3",
                           "--wait", "--timeout", "800", "--runs-dir", str(tmp_path / "runs"),
                           "--env", f"INPUT={corpus}"], cwd=REPO, env=dict(os.environ), capture_output=True,
                          text=True, timeout=860, check=False)
    logs = list((tmp_path / "runs").glob("*/logs/*-train_*.out"))
    text = logs[0].read_text() if logs else ""
    assert done.returncode == 0, done.stdout + done.stderr + text[-3000:]
    assert "on 1 node(s), 2 ranks" in text and "world=2 nodes=1" in text
    assert "iteration        3/       3" in text
