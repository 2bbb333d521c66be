"""``python -m trainer.bench.pipeline``: the same model through megatron-core's schedules and ours, side by side.

Each line (``--lines``) is a separate run of ``trainer.train`` (or, for ``direct-megatron``, of the
minimal megatron-core loop in trainer.bench.direct) on PP processes of this host, with identical
model, mock data, optimizer, precision, iterations and (except ``megatron-1f1b-default``) layer
split; each rank writes ``--metrics-dir`` JSON that this command reads -- no log scraping. Scenarios
(``--scenarios``): (a) uniform, (b) variable lengths (``--variable-seq-lengths`` with mock documents of
``--seq-len-dist`` lengths, the same for every line), (c) transient stalls (``--stall``, the same ops
for every line). Writes ``--report`` (markdown) and one timeline
PNG per line beside it; ``--out`` keeps each line's metrics, logs and traces.

GPU, the benchmark model gpt16-h2048 (4 GPUs): ``python -m trainer.bench.pipeline --out $OUT/bench --report
$OUT/benchmarks.md``. CPU dry run: ``--device cpu --num-layers 4 --hidden-size 32 ...`` (the trainer
runs CPU jobs without --use-dpp on our runtime's static policies, so there the "megatron" lines run those,
labelled so).
Named experiments with dated result files: ``python -m trainer.bench.run NAME`` (trainer/bench/experiments.py).
Exit status: 0 when every planned line ran, 1 when some failed (the report says which), 2 bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from trainer.bench.experiments import MODELS
from trainer.bench.launch_probe import probe_in_subprocess
from trainer.bench.layouts import Layout, parse_layouts
from trainer.bench.lines import (
    CATALOGUE,
    DEFAULT_LINES,
    LAYOUT_DEFAULT_LINES,
    SCENARIOS,
    BenchConfig,
    Line,
    NotRun,
    line_entry,
    plan,
    variable_length_tokens,
)
from trainer.bench.report import plot_kernel_timeline, plot_trace_timeline, write_report
from trainer.bench.results import LineResult, line_result
from trainer.cli import OneLineParser
from trainer.config import field_docs
from trainer.launch.cpu_binding import numa_cpu_sets
from trainer.launch.local_ranks import run_ranks
from trainer.problems import problems_text


def _pair(text: str) -> tuple[int, int]:
    first, last = text.split(",")
    return int(first), int(last)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m trainer.bench.pipeline", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    docs = field_docs(BenchConfig)
    for f in dataclasses.fields(BenchConfig):
        if f.name == "layout":  # set per --layouts entry, not a flag
            continue
        flag = "--" + f.name.replace("_", "-")
        helptext = docs.get(f.name, "").replace("%", "%%")
        if f.name == "bf16":
            parser.add_argument("--no-bf16", dest="bf16", action="store_false", help=helptext)
        elif f.name in ("split", "split_vp"):
            parser.add_argument(flag, type=_pair, default=None, metavar="FIRST,LAST", help=helptext)
        elif f.name in ("extra", "model_flags"):
            parser.add_argument(flag, default="", metavar="'FLAGS'", help=helptext + " (one quoted string)")
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default, help=helptext)
    parser.add_argument("--lines", default=None,
                        help=f"comma-separated, from: {', '.join(CATALOGUE)}; any DPP line with -qK "
                             "appended adds --dpp-max-queued-ops K (e.g. dpp-graphs-q2). Default: "
                             f"{','.join(DEFAULT_LINES)}; with --layouts: {','.join(LAYOUT_DEFAULT_LINES)}")
    parser.add_argument("--layouts", default="",
                        help="comma-separated PPxTPxDP[+sp][+overlap][+distopt][@MODEL] (e.g. 4x1x1,2x2x1+sp,"
                             "2x1x2+overlap+distopt,4x1x1@bert16-h2048): run the lines once per layout, one table "
                             "each (trainer/bench/layouts.py); @MODEL runs that layout on a benchmark model of "
                             "trainer/bench/experiments.py instead of the model flags; overrides --pipeline-parallel")
    parser.add_argument("--resplit", choices=("none", "auto"), default="none",
                        help="auto: a short profiling round per chunk count fits the stage balance and the lines "
                             "run on the re-split it recommends (trainer/bench/resplit.py); the report says "
                             "which split each line ran and why")
    parser.add_argument("--scenarios", default="a,b,c", help="comma-separated, from a (uniform), "
                        "b (variable lengths), c (transient stalls), d (variable lengths of --corpus)")
    parser.add_argument("--out", type=Path, required=True, help="folder for each line's metrics, logs, traces")
    parser.add_argument("--report", type=Path, required=True, help="markdown report to write; PNGs go beside it")
    parser.add_argument("--line-timeout", type=float, default=300.0, help="seconds before a line is killed")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (unless set)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole list of lines this many times, interleaved (A B C A B C), and pool "
                             "each line's iterations: on a noisy host, drift then hits every line alike")
    parser.add_argument("--dry-plan", action="store_true", help="print the planned command lines and exit")
    return parser


def _config(args: argparse.Namespace) -> BenchConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig) if f.name != "layout"}
    values["extra"] = tuple(shlex.split(args.extra))
    values["model_flags"] = tuple(shlex.split(args.model_flags))
    return BenchConfig(**values)


def _available_policies() -> tuple[str, ...]:
    import trainer.config as config

    return tuple(getattr(config, "DPP_POLICIES", ("dpp",)))


def _problems(args: argparse.Namespace) -> list[str]:
    p = [f"--lines: unknown line {n!r}" for n in _line_names(args) if line_entry(n) is None]
    layouts, layout_problems = parse_layouts(args.layouts)
    p += layout_problems
    p += [f"--layouts {lay.label}: megatron-core's distributed optimizer supports Adam only; pass --optimizer adam "
          f"(got {args.optimizer})" for lay in layouts if "distopt" in lay.options and args.optimizer != "adam"]
    p += [f"--scenarios: unknown scenario {s!r}" for s in args.scenarios.split(",") if s not in SCENARIOS]
    if "d" in args.scenarios.split(","):
        if not args.corpus:
            p.append("--scenarios d needs --corpus PREFIX (a GPT-2-tokenized indexed corpus)")
        elif not (Path(args.corpus + ".bin").is_file() and Path(args.corpus + ".idx").is_file()):
            p.append(f"--corpus {args.corpus}: no {args.corpus}.bin / .idx (preprocess it first, see --help)")
        p += [f"--{k}-file {v}: not found" for k, v in (("vocab", args.vocab_file), ("merge", args.merge_file))
              if not Path(v).is_file()]
    if "b" in args.scenarios.split(","):
        from trainer.data.varlen import parse_length_distribution

        p += parse_length_distribution(args.seq_len_dist)[1]
        if args.seq_length_divisible_by < 1:
            p.append(f"--seq-length-divisible-by={args.seq_length_divisible_by} must be >= 1")
    p += _stage_layers_problems(args, layouts)
    if not 0 <= args.attention_share < 1:
        p.append(f"--attention-share={args.attention_share} must lie in [0, 1) (0: by the model's FLOPs)")
    if args.cpu_bind not in ("numa", "none"):
        p.append(f"--cpu-bind={args.cpu_bind!r} must be numa or none")
    if args.device not in ("cuda", "cpu"):
        p.append(f"--device={args.device!r} must be cuda or cpu")
    if args.model not in ("gpt", "bert"):
        p.append(f"--model={args.model!r} must be gpt or bert")
    return p


def _stage_layers_problems(args: argparse.Namespace, layouts: list[Layout]) -> list[str]:
    """--pipeline-stage-layers against --split, the layers and every pipeline size it would run at (a layout
    naming its own model takes that model's balanced split instead)."""
    from trainer.schedule.stage_parts import parse_stage_layers, stage_layers_problems

    p: list[str] = []
    sizes = {lay.pipeline_parallel for lay in layouts if not lay.model} if layouts else {args.pipeline_parallel}
    for text, split, vp, suffix in ((args.pipeline_stage_layers, args.split, 1, ""),
                                    (args.pipeline_stage_layers_vp, args.split_vp, 2, "-vp")):
        if not text:
            continue
        if split is not None:
            p.append(f"--pipeline-stage-layers{suffix} and --split{suffix}: give one (the first places every "
                     f"{'virtual ' if vp > 1 else ''}stage of the v={vp} lines)")
        try:
            counts = parse_stage_layers(text)
        except ValueError as err:
            p.append(str(err))
            continue
        for pp in sorted(sizes):
            p += stage_layers_problems(args.num_layers, pp, vp, counts)
    return p


def _line_names(args: argparse.Namespace) -> list[str]:
    if args.lines is not None:
        return args.lines.split(",")
    return list(LAYOUT_DEFAULT_LINES if args.layouts else DEFAULT_LINES)


def _run_line(line: Line, cfg: BenchConfig, args: argparse.Namespace,
              cpu_sets: list[list[int]] | None) -> LineResult:
    folder = args.out / line.key
    extra = ["--metrics-dir", str(folder)]
    if cfg.device == "cpu" and line.module == "trainer.train":
        extra += ["--profile-dir", str(folder / "traces")]  # CPU: no kernels, so our span tracer draws it
    run = run_ranks(line.module, line.args + extra, line.world_size or cfg.world_size, folder, cfg.device,
                    args.line_timeout, args.threads, cpu_sets=cpu_sets)
    result = line_result(line.key, line.name, line.scenario, line.label, folder, cfg.skip_iters)
    if line.scenario in ("b", "d"):  # the trainer counts batch x --seq-length; count the documents' real tokens
        result.tokens_per_iteration = round(variable_length_tokens(cfg, line.scenario)[0])
    if run.returncode != 0:
        why = "timed out" if run.timed_out else f"exit {run.returncode}"
        result.status = f"FAILED ({why} after {run.seconds:.0f} s); log tail:\n{run.tail()}"
    print(f"[bench] {line.key}: " + (f"median {result.median_ms:.1f} ms/iter, {run.seconds:.0f} s"
                                     if result.ok else result.status), flush=True)
    return result


def _picture(result: LineResult, folder: Path, report: Path) -> str | None:
    # Named after the report too: two calls writing reports into one folder keep both pictures.
    # File names keep to [A-Za-z0-9._-]: a layout key's "+" (2x2x1+sp) is spelt "-" there, so copying tools
    # and links never have to quote it.
    path = report.parent / f"{report.stem}.timeline-{result.key.replace('+', '-')}.png"
    if plot_kernel_timeline(result, path) or plot_trace_timeline(folder / "traces", path):
        return path.name
    return None


def _layout_configs(args: argparse.Namespace) -> list[BenchConfig]:
    """One configuration per --layouts entry (PP from the layout), or the one of the flags. A layout naming a
    model (``@NAME``) takes that model's fields and its own balanced split: --split was given for the flags'
    model."""
    base = _config(args)
    layouts = parse_layouts(args.layouts)[0]

    def model_of(lay: Layout) -> dict[str, object]:
        return ({**MODELS[lay.model].bench_fields(), "split": None, "split_vp": None, "pipeline_stage_layers": "",
                 "pipeline_stage_layers_vp": ""}
                if lay.model else {})

    return [dataclasses.replace(base, pipeline_parallel=lay.pipeline_parallel, layout=lay, **model_of(lay))
            for lay in layouts] or [base]


def _resplit(configs: list[BenchConfig], names: list[str], args: argparse.Namespace,
             cpu_sets: list[list[int]] | None) -> tuple[list[BenchConfig], list[str]]:
    """--resplit auto: each layout's profiling round(s) and the split its lines then run on."""
    from trainer.bench.resplit import choose_splits

    chosen_configs, notes = [], []
    for c in configs:
        chosen, choices = choose_splits(c, names, _available_policies(),
                                        lambda line, short: _run_line(line, short, args, cpu_sets))
        chosen_configs.append(chosen)
        prefix = f"{c.layout.label}: " if c.layout is not None else ""
        notes += [prefix + choice.note().removeprefix("- ") for choice in choices]
    for note in notes:
        print(f"[bench] split: {note}", flush=True)
    return chosen_configs, notes


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = _problems(args)
    if problems:
        return parser.report(problems_text(problems))
    names, scenarios = _line_names(args), args.scenarios.split(",")
    configs = _layout_configs(args)
    cfg = max(configs, key=lambda c: c.world_size)  # CPU binding and the report's header: the widest layout
    cpu_sets = None
    if cfg.cpu_bind == "numa" and not args.dry_plan:  # one plan for every line of the call
        cpu_sets, account = numa_cpu_sets(cfg.world_size, cfg.device)
        print(f"[bench] CPU binding: {account}", flush=True)
    notes: list[str] = []
    if args.resplit == "auto" and not args.dry_plan:
        configs, notes = _resplit(configs, names, args, cpu_sets)
    planned = [(c, item) for c in configs for item in plan(c, names, scenarios, _available_policies())]
    config_of = {item.key: c for c, item in planned if isinstance(item, Line)}
    planned = [item for _, item in planned]
    lines = [p for p in planned if isinstance(p, Line)]
    not_run = [p for p in planned if isinstance(p, NotRun)]
    commands = {ln.key: f"python -m {ln.module} {shlex.join(ln.args)}" for ln in lines}
    for item in not_run:
        print(f"[bench] not run: ({item.scenario}) {item.name}: {item.reason}", flush=True)
    if args.dry_plan:
        print("\n".join(f"{key}: {command}" for key, command in commands.items()))
        return 0
    host = probe_in_subprocess() if cfg.device == "cuda" else ""
    if host:
        print(f"[bench] host: {host}", flush=True)
    start = time.monotonic()
    results: dict[str, LineResult] = {}
    pictures: dict[str, str] = {}
    for round_ in range(args.rounds):
        for line in lines:
            result = _run_line(line, config_of[line.key], args, cpu_sets)
            if result.ok:
                result.round_medians = [result.median_ms]
            if round_ and line.key in results and results[line.key].ok and result.ok:
                results[line.key].timed_ms.extend(result.timed_ms)  # pooled over rounds
                results[line.key].timed_batches.extend(result.timed_batches)
                results[line.key].round_medians.append(result.median_ms)
            elif not round_ or not result.ok:
                results[line.key] = result  # first round, or a failure that must show
            picture = _picture(result, args.out / line.key, args.report) if not round_ else None
            if picture:
                pictures[line.key] = picture
            # Rewritten after every line: a call cut off by its time limit still leaves a report.
            write_report(args.report, cfg, list(results.values()), not_run, commands, pictures,
                         time.monotonic() - start, host, layouts={ln.key: ln.layout for ln in lines if ln.layout},
                         notes=notes, configs={c.layout.label: c for c in configs if c.layout is not None})
    print(f"[bench] wrote {args.report} and {len(pictures)} timeline(s)", flush=True)
    return 0 if all(r.ok for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
