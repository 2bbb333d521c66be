"""``python -m trainer.bench.pipeline`` end to end on CPU: tiny GPT, gloo, PP=2, two scenarios.

On CPU the "megatron" lines run our runtime's static policies (labelled so) and the direct
megatron-core line is listed as not run with its reason; scenario (b) runs every line on the same
variable-length mock documents (--variable-seq-lengths).
The full run (three lines, three scenarios) takes 1-2 minutes on a 2-core machine (mostly process
start-up), hence slow; `make test` runs the one-scenario version below, which keeps every check of a
single scenario (the schedule-vs-static experiment of tests/dist/test_bench_run.py also runs scenario c).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.launch import REPO
from tests.model_flags import model_flags

TINY = [*model_flags(layers=4, mock_data=False), "--micro-batch-size", "2", "--num-microbatches", "4",
        "--pipeline-parallel", "2", "--train-iters", "4", "--no-bf16", "--stall", "1:0.3:5:7",
        "--seq-length-divisible-by", "4", "--extra", "--dpp-timeout 120"]


def dry_run(tmp_path: Path, lines: str, scenarios: str) -> tuple[Path, str]:
    """Run the benchmark tool on TINY with ``lines`` and ``scenarios``; its report's path and text."""
    report = tmp_path / "report" / "benchmarks.md"
    done = subprocess.run([sys.executable, "-m", "trainer.bench.pipeline", *TINY, "--lines", lines,
                           "--scenarios", scenarios, "--out", str(tmp_path / "runs"), "--report", str(report)],
                          cwd=REPO, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return report, report.read_text()


def assert_every_line_listed(text: str) -> None:
    """Scenario (b)'s flags are stated, and the lines that cannot run on CPU are listed, not dropped."""
    assert "`--variable-seq-lengths --mock-seq-len-dist lognormal:0.6 --seq-length-divisible-by 4`" in text
    assert "direct-megatron**: trainer.bench.direct runs on CUDA only" in text  # listed, not skipped silently
    assert "CPU stand-in: our runtime's static 1f1b policy" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_dry_run_writes_report_and_timelines(tmp_path: Path) -> None:
    report, text = dry_run(tmp_path, "megatron-1f1b-default,megatron-1f1b-best,dpp,direct-megatron", "a,b,c")
    assert "not available until" not in text  # every scenario runs; none is left for later
    assert_every_line_listed(text)
    for scenario in ("a", "b", "c"):
        for line in ("megatron-1f1b-default", "megatron-1f1b-best", "dpp"):
            assert (report.parent / f"{report.stem}.timeline-{scenario}-{line}.png").stat().st_size > 1000
    rows = [r for r in text.splitlines() if r.startswith("| dpp |")]
    assert len(rows) == 3 and "3/1" in rows[0]  # the balanced split (head weighs 2 layers) on 2 stages
    assert "| 1.000x |" in text  # the best megatron line is its own bar
    # same seed, same stalled ops under every schedule of scenario (c)
    stalled = {r.split("|")[-2].strip() for r in text.split("## (c)")[1].splitlines() if r.startswith("| megatron")
               or r.startswith("| dpp |")}
    assert len(stalled) == 1 and stalled != {""}
    # every line trains the same model from the same data: first-iteration losses of lines with the
    # same split agree (dpp vs the static 1f1b policy: identical on CPU)
    for section in text.split("Losses of the first iterations")[1:3]:  # scenarios (a) and (b)
        losses = section.splitlines()[4]
        cells = [c.strip() for c in losses.split("|")[2:-1]]
        assert cells[1] == cells[2], losses
    # variable lengths are other data: scenario (b)'s first loss differs from (a)'s
    first = [t.split("Losses of the first iterations")[1].splitlines()[4] for t in text.split("## (b)")]
    assert first[0] != first[1]


@pytest.mark.timeout(600)
def test_cpu_dry_run_of_variable_lengths_writes_report_and_timeline(tmp_path: Path) -> None:
    """Scenario (b) alone, the two lines that run on CPU plus the listed direct-megatron one."""
    report, text = dry_run(tmp_path, "megatron-1f1b-best,dpp,direct-megatron", "b")
    assert_every_line_listed(text)
    for line in ("megatron-1f1b-best", "dpp"):
        assert (report.parent / f"{report.stem}.timeline-b-{line}.png").stat().st_size > 1000
    rows = [r for r in text.splitlines() if r.startswith("| dpp |")]
    assert len(rows) == 1 and "3/1" in rows[0]  # the balanced split (head weighs 2 layers) on 2 stages
    assert "| 1.000x |" in text  # the best megatron line is its own bar
    # both lines train the same model (same split) from the same data: equal first-iteration losses
    losses = text.split("Losses of the first iterations")[1].splitlines()[4]
    cells = [c.strip() for c in losses.split("|")[2:-1]]
    assert len(cells) == 2 and cells[0] == cells[1], losses
