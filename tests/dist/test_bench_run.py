"""``python -m trainer.bench.run`` end to end on CPU (``--device cpu``: the tiny model, PP=2): the
experiment runs through its tool and a dated result file with the required header lands in --results."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.launch import REPO
from trainer.bench.run import REQUIRED_FIELDS

DATED = re.compile(r"^20[0-9]{2}-[0-9]{2}-[0-9]{2}-(?P<name>[a-z-]+)-cpu\.md$")


def _run(tmp_path: Path, name: str) -> str:
    results = tmp_path / "results"
    done = subprocess.run([sys.executable, "-m", "trainer.bench.run", name, "--device", "cpu", "--out",
                           str(tmp_path / "work"), "--results", str(results)],
                          cwd=REPO, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = list(results.glob("*.md"))
    assert len(files) == 1 and (m := DATED.match(files[0].name)) and m["name"] == name, files
    text = files[0].read_text()
    for field in REQUIRED_FIELDS:
        assert re.search(rf"^\| {field} \| .+ \|$", text, re.M), field
    return text


@pytest.mark.timeout(300)
def test_transport_experiment_writes_a_dated_result(tmp_path: Path) -> None:
    text = _run(tmp_path, "transport")
    assert "trainer.transport.bench --device cpu --sizes 64K,1M" in text
    assert "64K" in text.split("## Report", 1)[1]  # the tool's table is in the file


@pytest.mark.timeout(600)
def test_schedule_experiment_writes_a_dated_result_with_the_report(tmp_path: Path) -> None:
    text = _run(tmp_path, "schedule-vs-static")
    report = text.split("## Report", 1)[1]
    assert "model **tiny**" in text and "scenario d not run: no --corpus given" in text
    assert "CPU stand-in: our runtime's static 1f1b policy" in report  # megatron-1f1b-best ran
    assert "**1f1b-graphs**: CUDA graphs need CUDA" in report  # graphed lines listed, not skipped silently
    assert "| 1 | " in report  # the losses table
