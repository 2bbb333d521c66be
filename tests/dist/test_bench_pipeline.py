"""``python -m trainer.bench.pipeline`` end to end on CPU: tiny GPT, gloo, PP=2, two scenarios.

On CPU the "megatron" lines run our runtime's static policies (labelled so) and the direct
megatron-core line is listed as not run with its reason; scenario (b) says it waits for issue 13.
About 1-2 minutes on a 2-core machine (mostly process start-up), hence slow.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.launch import REPO

TINY = ["--device", "cpu", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2", "--num-microbatches", "4",
        "--pipeline-parallel", "2", "--train-iters", "4", "--no-bf16", "--stall", "1:0.3:5:7",
        "--extra", "--dpp-timeout 120"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_dry_run_writes_report_and_timelines(tmp_path: Path) -> None:
    report = tmp_path / "report" / "benchmarks.md"
    done = subprocess.run([sys.executable, "-m", "trainer.bench.pipeline", *TINY, "--lines",
                           "megatron-1f1b-default,megatron-1f1b-best,dpp,direct-megatron", "--scenarios", "a,b,c",
                           "--out", str(tmp_path / "runs"), "--report", str(report)],
                          cwd=REPO, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    assert "not available until issue 13 lands" in text
    assert "direct-megatron**: megatron-core's schedules need CUDA" in text  # listed, not skipped silently
    assert "CPU stand-in: our runtime's static 1f1b policy" in text
    for scenario in ("a", "c"):
        for line in ("megatron-1f1b-default", "megatron-1f1b-best", "dpp"):
            assert (report.parent / f"timeline-{scenario}-{line}.png").stat().st_size > 1000
    rows = [r for r in text.splitlines() if r.startswith("| dpp |")]
    assert len(rows) == 2 and "3/1" in rows[0]  # the balanced split (head weighs 2 layers) on 2 stages
    assert "| 1.000x |" in text  # the best megatron line is its own bar
    # same seed, same stalled ops under every schedule of scenario (c)
    stalled = {r.split("|")[-2].strip() for r in text.split("## (c)")[1].splitlines() if r.startswith("| megatron")
               or r.startswith("| dpp |")}
    assert len(stalled) == 1 and stalled != {""}
    # every line trains the same model from the same data: first-iteration losses of lines with the
    # same split agree (dpp vs the static 1f1b policy: identical on CPU)
    losses = text.split("Losses of the first iterations")[1].splitlines()[4]
    cells = [c.strip() for c in losses.split("|")[2:-1]]
    assert cells[1] == cells[2], losses
