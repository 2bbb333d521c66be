"""trainer.bench.launch_probe: the benchmark's host launch-rate line, and its clear failure without CUDA."""

from __future__ import annotations

import torch

from trainer.bench.launch_probe import LINE, probe_in_subprocess


def test_the_probe_line_is_read_back() -> None:
    match = LINE.search("noise\n[host] NVIDIA H100 80GB HBM3: 10.05 us per eager kernel launch (host side, 20000 launches)\n")
    assert match is not None and match["device"] == "NVIDIA H100 80GB HBM3" and float(match["us"]) == 10.05


def test_without_cuda_the_report_says_why_instead_of_failing() -> None:
    text = probe_in_subprocess(timeout_s=120)
    if torch.cuda.is_available():
        assert "us per eager kernel launch" in text or "µs per eager kernel launch" in text
    else:
        assert text == "launch probe failed (exit 1): python -m trainer.bench.launch_probe: no CUDA device"
