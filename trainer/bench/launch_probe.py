"""``python -m trainer.bench.launch_probe [--launches N]``: how fast this host queues CUDA kernels.

Microseconds of host time per eager launch of a tiny kernel on GPU 0 (one process). It decides
whether megatron-core's eager pipeline stages are launch-bound: on 4×H100 hosts of the same kind the
eager 1F1B ran 571 ms on one host and 840–877 ms on others (10 µs per launch measured there), while
DPP's CUDA-graph lines took the same time on both (docs/benchmarks.md). The pipeline
benchmark runs this once per call and prints the figure in its report, so calls on different hosts
are not compared blindly.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence

from trainer.cli import OneLineParser

LINE = re.compile(r"\[host\] (?P<device>.+): (?P<us>[0-9.]+) us per eager kernel launch")


def measure(launches: int) -> tuple[str, float]:
    """(device name, µs of host time per launch of ``x.add_(1)`` on a 16-element CUDA tensor)."""
    import torch

    x = torch.zeros(16, device="cuda")
    for _ in range(min(2000, launches)):  # warm-up: lazy init, allocator, launch path
        x.add_(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return torch.cuda.get_device_name(), host / launches * 1e6


def probe_in_subprocess(timeout_s: float = 120.0) -> str:
    """The probe's one-line result from a fresh process (the caller keeps no CUDA context), or why
    there is none; never raises."""
    try:
        run = subprocess.run([sys.executable, "-m", "trainer.bench.launch_probe"], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as error:
        return f"launch probe failed: {error}"
    match = LINE.search(run.stdout)
    if run.returncode != 0 or match is None:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"launch probe failed (exit {run.returncode}): {tail[0]}"
    return f"{float(match['us']):.2f} µs per eager kernel launch on {match['device']} (host side)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.bench.launch_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20000, help="timed launches (default 20000)")
    args = parser.parse_args(argv)
    if args.launches < 1:
        parser.error(f"--launches={args.launches} must be >= 1")
    import torch

    if not torch.cuda.is_available():
        print("python -m trainer.bench.launch_probe: no CUDA device", file=sys.stderr)
        return 1
    device, us = measure(args.launches)
    print(f"[host] {device}: {us:.2f} us per eager kernel launch (host side, {args.launches} launches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
