"""One GPU, the ranks of a pipeline sharing it (gloo): each rank's peak *reserved* memory for DPP lines of
the pipeline benchmark. Memory per process does not depend on which GPU the other ranks use, so this
measures what a run with one GPU per rank would reserve; times mean nothing here. megatron-core's own
lines cannot run so (NCCL refuses two ranks on one GPU): the eager ``dpp`` line, at 1F1B's caps,
stands in for them (on 2xH100, PP=2, the two reserved 8.62 vs 8.55 GiB).

    python3 scripts/device/mem_1gpu.py [--pp4] LINE [LINE ...]   (bench line names, e.g. dpp dpp-graphs-rc)

The lines and their flags are the benchmark's own (trainer.bench.lines.plan, scenario a) with
--distributed-backend gloo added: PP=2, GPT 8 layers, or with --pp4 the benchmark model gpt16-h2048
(16 layers, PP=4, M=32). Short runs: 4 iterations.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trainer.bench.lines import BenchConfig, Line, plan
from trainer.bench.results import line_result
from trainer.launch.local_ranks import run_ranks

PP2 = BenchConfig(pipeline_parallel=2, num_layers=8, num_microbatches=16, train_iters=4, gpu_busy_iters=0)
PP4 = BenchConfig(train_iters=4, gpu_busy_iters=0)
GIB = 2**30


def main(argv: list[str]) -> int:
    pp4 = "--pp4" in argv
    names = [a for a in argv if a != "--pp4"] or ["dpp", "dpp-graphs", "dpp-graphs-rc", "dpp-graphs-rc-cf1.5"]
    cfg = PP4 if pp4 else PP2
    for line in plan(cfg, names, ["a"], ("dpp",)):
        if not isinstance(line, Line):
            print(f"== {line.name}: not run: {line.reason}")
            continue
        out = Path("/tmp/mem1") / f"pp{cfg.pipeline_parallel}-{line.name}"
        start = time.monotonic()
        run = run_ranks(line.module, [*line.args, "--distributed-backend", "gloo", "--metrics-dir", str(out)],
                        cfg.pipeline_parallel, out, "cuda", timeout_s=240, threads=4)
        result = line_result(line.key, line.name, line.scenario, line.label, out, cfg.skip_iters)
        print(f"== {line.name}: rc={run.returncode} {time.monotonic() - start:.0f}s losses {result.losses[-2:]}",
              flush=True)
        text = "".join(log.read_text(errors="replace") for log in run.logs)
        for graphs in sorted({ln.split("INFO ")[-1] for ln in text.splitlines() if "reserved for them" in ln}):
            print("   ", graphs)
        for doc in sorted(result.metrics, key=lambda d: d["rank"]):
            print(f"    rank {doc['rank']}: peak reserved {(doc['peak_reserved_bytes'] or 0) / GIB:.2f} GiB, "
                  f"allocated {(doc['peak_memory_bytes'] or 0) / GIB:.2f} GiB")
        if run.returncode:
            print("\n".join(text.splitlines()[-25:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
