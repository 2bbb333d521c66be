"""Micro-benchmark of the tracer's cost: ``python -m trainer.profiling.overhead``.

Times an empty block four ways (bare, NullTracer span, Tracer span, Tracer.record) and the
close-time write of the recorded events, and prints µs per call; docs/profiling.md records the
figures and what they mean against a pipeline step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from types import MappingProxyType

from trainer.cli import OneLineParser
from trainer.profiling.tracer import NullTracer, make_tracer, now_us

BENCH_METADATA = MappingProxyType({"stage": 0, "world_size": 1, "pipeline_parallel": 1, "num_chunks": 1,
                                   "num_microbatches": 1, "schedule": "bench",
                                   "run_id": "bench"})


def best_us_per_call(fn: Callable[[], None], calls: int, repeats: int = 5) -> float:
    """Minimum over ``repeats`` of the mean time per call (the least disturbed measurement)."""
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6


def measure(calls: int = 200_000) -> dict[str, float]:
    """µs per call of each variant, and µs per event of writing the trace file at close."""
    null = NullTracer()
    with tempfile.TemporaryDirectory() as folder:
        tracer = make_tracer(folder, rank=0, metadata=BENCH_METADATA)

        def bare() -> None:
            pass

        def null_span() -> None:
            with null.span("F3.c0", "F", microbatch=3, chunk=0):
                pass

        def traced_span() -> None:
            with tracer.span("F3.c0", "F", microbatch=3, chunk=0):
                pass

        def traced_record() -> None:
            start = now_us()
            tracer.record("send act m3.c0", "send", start, start, tid="comm", microbatch=3, chunk=0)

        results = {name: best_us_per_call(fn, calls) for name, fn in
                   (("bare block", bare), ("NullTracer.span", null_span), ("Tracer.span", traced_span),
                    ("Tracer.record", traced_record))}
        events = tracer.num_events
        start = time.perf_counter()
        tracer.close()
        results["close() per event"] = (time.perf_counter() - start) / events * 1e6
    return results


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.profiling.overhead", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000, help="calls per timing repeat")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls={args.calls} must be >= 1")
    for name, us in measure(args.calls).items():
        print(f"{name:>20}: {us:7.3f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
