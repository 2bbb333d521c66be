"""``python -m trainer.bench.pipeline`` on CPU (tiny GPT, gloo): the static-order bars and the three-ratio
headline with ``--resplit auto``, and ``--layouts`` with one table per layout.

On CPU the graphed lines are listed as not run (CUDA graphs need CUDA); their eager twins run the same
static orders in the DPP runtime, so the headline's second ratio is taken against them and says so.
Busy time per stage is our runtime's traced host spans there. Slow: several lines of process start-up.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.launch import REPO
from tests.model_flags import model_flags

TINY = [*model_flags(layers=4, mock_data=False), "--micro-batch-size", "2", "--num-microbatches", "4",
        "--pipeline-parallel", "2", "--train-iters", "4", "--no-bf16", "--extra", "--dpp-timeout 120"]


def _bench(tmp_path: Path, *args: str) -> str:
    report = tmp_path / "report" / "benchmarks.md"
    done = subprocess.run([sys.executable, "-m", "trainer.bench.pipeline", *TINY, *args, "--scenarios", "a",
                           "--out", str(tmp_path / "runs"), "--report", str(report)],
                          cwd=REPO, capture_output=True, text=True, timeout=860)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return report.read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_dry_run_states_three_ratios_and_the_split_it_chose(tmp_path: Path) -> None:
    text = _bench(tmp_path, "--lines", "megatron-1f1b-best,1f1b-eager,zb-h1-eager,dpp,1f1b-graphs",
                  "--resplit", "auto")
    assert "## Layer split (--resplit auto)" in text
    assert "- v=1 lines ran the " in text and "profiling round of megatron-1f1b-best" in text
    assert "**Headline** — **dpp**" in text
    assert "1. vs megatron-core's best eager line (megatron-1f1b-best, " in text
    assert "2. vs the best static (eager: no graphed static line ran, e.g. on CPU) order in the same runtime (" in text
    assert "3. step vs its balanced limit (sum of per-stage busy / PP = " in text
    assert "host spans of our runtime (CPU run)" in text
    assert "(a) **1f1b-graphs**: CUDA graphs need CUDA" in text
    for name in ("1f1b-eager", "zb-h1-eager", "dpp"):
        assert any(row.startswith(f"| {name} |") for row in text.splitlines()), name
    # The static orders train the same model on the same data: equal first losses across lines.
    losses = text.split("Losses of the first iterations")[1].splitlines()[4]
    cells = [c.strip() for c in losses.split("|")[2:-1]]
    assert len(cells) == 4 and len(set(cells)) == 1, losses


@pytest.mark.timeout(300)
def test_a_distopt_layout_with_sgd_is_refused_before_running(tmp_path: Path) -> None:
    """Every `make test` (no rank starts): megatron-core's distributed optimizer takes Adam only."""
    refused = subprocess.run([sys.executable, "-m", "trainer.bench.pipeline", *TINY, "--layouts", "2x1x2+distopt",
                              "--out", str(tmp_path / "x"), "--report", str(tmp_path / "x.md")],
                             cwd=REPO, capture_output=True, text=True, timeout=240)
    assert refused.returncode == 2 and "supports Adam only; pass --optimizer adam (got sgd)" in refused.stderr
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())  # refused before any line ran


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_dry_run_writes_one_table_per_layout(tmp_path: Path) -> None:
    text = _bench(tmp_path, "--layouts", "2x1x1,2x1x2+overlap+distopt", "--optimizer", "adam")
    sections = text.split("## Layout ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["pp2xtp1xdp1", "pp2xtp1xdp2+overlap+distopt"]
    for section in sections:
        rows = [r for r in section.splitlines() if r.startswith("| megatron-1f1b-best |") or r.startswith("| dpp-default |")]
        assert len(rows) == 2, section[:2000]
        assert "**Headline** — **dpp-default**" in section
