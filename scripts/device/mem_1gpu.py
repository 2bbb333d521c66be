"""One GPU, the ranks of a pipeline sharing it (gloo): each rank's peak *reserved* memory for DPP lines of
the pipeline benchmark. Memory per process does not depend on which GPU the other ranks use, so this
measures what a run with one GPU per rank would reserve; times mean nothing here. megatron-core's own
lines cannot run so (NCCL refuses two ranks on one GPU): the eager ``dpp`` line, at 1F1B's caps,
stands in for them (on 2xH100, PP=2, the two reserved 8.62 vs 8.55 GiB).

    python3 scripts/device/mem_1gpu.py [--pp4|--bert] [--adam] [--fused] [--graph-mem] [--stage-layers=A,B,..]
                                       [--stage-layers-vp=A,B,..] LINE [LINE ...]
    (bench line names, e.g. dpp dpp-graphs-rc)

The lines and their flags are the benchmark's own (trainer.bench.lines.plan, scenario a) with
--distributed-backend gloo added: PP=2, GPT 8 layers, or with --pp4 the benchmark model gpt16-h2048
(16 layers, PP=4, M=32), or with --bert bert16-h2048 at PP=4. Short runs: 4 iterations. --adam: Adam, as
the layouts experiment runs (SGD otherwise); --fused: every line with --torch-optimizer-impl fused.
--stage-layers= / --stage-layers-vp=: every (virtual) stage's layers for the v=1 / v=2 lines, the bench's
--pipeline-stage-layers / --pipeline-stage-layers-vp (half layers allowed), instead of the balanced split.

--graph-mem (graphed lines): each line twice through scripts/device/graph_mem_probe.py, first with each
chunk's warm-up cache kept through its captures (as before it was released ahead of them), then as the
trainer runs now; per rank the peak reserved / allocated memory reached by the end of the capture and
the steady state's peak after it (the run's peak is the larger of the two).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from trainer.bench.experiments import MODELS
from trainer.bench.lines import BenchConfig, Line, plan
from trainer.bench.results import line_result
from trainer.config import DPP_POLICIES
from trainer.launch.local_ranks import run_ranks

PP2 = BenchConfig(pipeline_parallel=2, num_layers=8, num_microbatches=16, train_iters=4, gpu_busy_iters=0)
PP4 = BenchConfig(train_iters=4, gpu_busy_iters=0)
GIB = 2**30


PROBE = "scripts.device.graph_mem_probe"
KEEP = "GRAPH_MEM_KEEP_WARM_UP_CACHE"


OPTIONS = ("--pp4", "--bert", "--adam", "--fused", "--graph-mem")
VALUED = {"--stage-layers": "pipeline_stage_layers", "--stage-layers-vp": "pipeline_stage_layers_vp"}


def parse(argv: list[str]) -> tuple[BenchConfig, bool, list[str]]:
    """(the benchmark configuration, --graph-mem, line names); an unknown option is an error naming it."""
    valued = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("-") and "=" in a}
    flags = [a for a in argv if a.startswith("-") and "=" not in a]
    unknown = sorted((set(flags) - set(OPTIONS)) | (set(valued) - set(VALUED)))
    if unknown:
        raise SystemExit(f"mem_1gpu.py: unknown option(s) {', '.join(unknown)} "
                         f"({', '.join(OPTIONS)}, {'=, '.join(VALUED)}=)")
    names = [a for a in argv if not a.startswith("-")]
    graph_mem = "--graph-mem" in flags
    default = ["dpp-zb-graphs", "interleaved-graphs"] if graph_mem else \
        ["dpp", "dpp-graphs", "dpp-graphs-rc", "dpp-graphs-rc-cf1.5"]
    cfg = PP4 if "--pp4" in flags else PP2
    if "--bert" in flags:
        cfg = replace(PP4, **{**MODELS["bert16-h2048"].bench_fields(), "train_iters": PP4.train_iters})
    cfg = replace(cfg, optimizer="adam" if "--adam" in flags else cfg.optimizer,
                  torch_optimizer_impl="fused" if "--fused" in flags else cfg.torch_optimizer_impl,
                  **{VALUED[k]: v for k, v in valued.items()})
    return cfg, graph_mem, names or default


def _split_tag(cfg: BenchConfig, line: Line) -> str:
    """The run folder's suffix naming a given split, so runs of one line on two splits keep apart."""
    given = cfg.pipeline_stage_layers_vp if "--num-virtual-stages-per-pipeline-rank" in line.args \
        else cfg.pipeline_stage_layers
    return "-" + given.replace(",", "_") if given else ""


def run_line(cfg: BenchConfig, line: Line, tag: str, module: str, timeout_s: float, folder: str = "") -> None:
    out = Path("/tmp/mem1") / (f"{cfg.model}-pp{cfg.pipeline_parallel}-{cfg.optimizer}-{cfg.torch_optimizer_impl}"
                               f"-{line.name}{folder}{_split_tag(cfg, line)}")
    start = time.monotonic()
    run = run_ranks(module, [*line.args, "--distributed-backend", "gloo", "--metrics-dir", str(out)],
                    cfg.pipeline_parallel, out, "cuda", timeout_s=timeout_s, threads=4)
    result = line_result(line.key, line.name, line.scenario, line.label, out, cfg.skip_iters)
    print(f"== {line.name}{tag}: rc={run.returncode} {time.monotonic() - start:.0f}s losses {result.losses[-2:]}",
          flush=True)
    text = "".join(log.read_text(errors="replace") for log in run.logs)
    for graphs in sorted({ln.split("INFO ")[-1] for ln in text.splitlines()
                          if "reserved for them" in ln or "held cap fitted" in ln}):
        print("   ", graphs)
    for probe in sorted(ln for ln in text.splitlines() if ln.startswith("GRAPH_MEM ")):
        print("   ", probe)
    peak = "steady-state peak" if module == PROBE else "peak"
    for doc in [d for d in result.metrics if d["rank"] == 0]:
        print("    schedule:", doc.get("schedule"))
    for doc in sorted(result.metrics, key=lambda d: d["rank"]):
        print(f"    rank {doc['rank']}: {peak} reserved {(doc['peak_reserved_bytes'] or 0) / GIB:.2f} GiB, "
              f"allocated {(doc['peak_memory_bytes'] or 0) / GIB:.2f} GiB")
    if run.returncode:
        print("\n".join(text.splitlines()[-25:]))


def main(argv: list[str]) -> int:
    cfg, graph_mem, names = parse(argv)
    print(f"== {cfg.model} PP={cfg.pipeline_parallel} {cfg.num_layers} layers, {cfg.optimizer}, "
          f"--torch-optimizer-impl {cfg.torch_optimizer_impl}; layers per stage: v=1 "
          f"{cfg.pipeline_stage_layers or 'balanced'}, v=2 {cfg.pipeline_stage_layers_vp or 'balanced'}", flush=True)
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
