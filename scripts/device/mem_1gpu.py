"""One GPU, the ranks of a pipeline sharing it (gloo): each rank's peak *reserved* memory for DPP lines of
the pipeline benchmark. Memory per process does not depend on which GPU the other ranks use, so this
measures what a run with one GPU per rank would reserve; times mean nothing here. megatron-core's own
lines cannot run so (NCCL refuses two ranks on one GPU): the eager ``dpp`` line, at 1F1B's caps,
stands in for them (on 2xH100, PP=2, the two reserved 8.62 vs 8.55 GiB).

    python3 scripts/device/mem_1gpu.py [--pp4] [--graph-mem] LINE [LINE ...]   (bench line names, e.g. dpp dpp-graphs-rc)

The lines and their flags are the benchmark's own (trainer.bench.lines.plan, scenario a) with
--distributed-backend gloo added: PP=2, GPT 8 layers, or with --pp4 the benchmark model gpt16-h2048
(16 layers, PP=4, M=32). Short runs: 4 iterations.

--graph-mem (graphed lines): each line twice through scripts/device/graph_mem_probe.py, first with each
chunk's warm-up cache kept through its captures (as before it was released ahead of them), then as the
trainer runs now; per rank the peak reserved / allocated memory reached by the end of the capture and
the steady state's peak after it (the run's peak is the larger of the two).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from trainer.bench.lines import BenchConfig, Line, plan
from trainer.bench.results import line_result
from trainer.config import DPP_POLICIES
from trainer.launch.local_ranks import run_ranks

PP2 = BenchConfig(pipeline_parallel=2, num_layers=8, num_microbatches=16, train_iters=4, gpu_busy_iters=0)
PP4 = BenchConfig(train_iters=4, gpu_busy_iters=0)
GIB = 2**30


PROBE = "scripts.device.graph_mem_probe"
KEEP = "GRAPH_MEM_KEEP_WARM_UP_CACHE"


def parse(argv: list[str]) -> tuple[bool, bool, list[str]]:
    """(--pp4, --graph-mem, line names); an unknown option is an error naming it."""
    flags = [a for a in argv if a.startswith("-")]
    unknown = sorted(set(flags) - {"--pp4", "--graph-mem"})
    if unknown:
        raise SystemExit(f"mem_1gpu.py: unknown option(s) {', '.join(unknown)} (--pp4, --graph-mem)")
    names = [a for a in argv if not a.startswith("-")]
    graph_mem = "--graph-mem" in flags
    default = ["dpp-zb-graphs", "interleaved-graphs"] if graph_mem else \
        ["dpp", "dpp-graphs", "dpp-graphs-rc", "dpp-graphs-rc-cf1.5"]
    return "--pp4" in flags, graph_mem, names or default


def run_line(cfg: BenchConfig, line: Line, tag: str, module: str, timeout_s: float, folder: str = "") -> None:
    out = Path("/tmp/mem1") / f"pp{cfg.pipeline_parallel}-{line.name}{folder}"
    start = time.monotonic()
    run = run_ranks(module, [*line.args, "--distributed-backend", "gloo", "--metrics-dir", str(out)],
                    cfg.pipeline_parallel, out, "cuda", timeout_s=timeout_s, threads=4)
    result = line_result(line.key, line.name, line.scenario, line.label, out, cfg.skip_iters)
    print(f"== {line.name}{tag}: rc={run.returncode} {time.monotonic() - start:.0f}s losses {result.losses[-2:]}",
          flush=True)
    text = "".join(log.read_text(errors="replace") for log in run.logs)
    for graphs in sorted({ln.split("INFO ")[-1] for ln in text.splitlines() if "reserved for them" in ln}):
        print("   ", graphs)
    for probe in sorted(ln for ln in text.splitlines() if ln.startswith("GRAPH_MEM ")):
        print("   ", probe)
    peak = "steady-state peak" if module == PROBE else "peak"
    for doc in sorted(result.metrics, key=lambda d: d["rank"]):
        print(f"    rank {doc['rank']}: {peak} reserved {(doc['peak_reserved_bytes'] or 0) / GIB:.2f} GiB, "
              f"allocated {(doc['peak_memory_bytes'] or 0) / GIB:.2f} GiB")
    if run.returncode:
        print("\n".join(text.splitlines()[-25:]))


def main(argv: list[str]) -> int:
    pp4, graph_mem, names = parse(argv)
    cfg = PP4 if pp4 else PP2
    for line in plan(cfg, names, ["a"], DPP_POLICIES):
        if not isinstance(line, Line):
            print(f"== {line.name}: not run: {line.reason}")
            continue
        if not graph_mem:
            run_line(cfg, line, "", line.module, 240)
            continue
        for keep, tag, folder in (("1", " [before: warm-up cache kept]", "-kept"), ("0", " [after]", "-released")):
            os.environ[KEEP] = keep  # the ranks inherit this process's environment
            run_line(cfg, line, tag, PROBE, 110, folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
