"""``python -m trainer.bench.run EXPERIMENT``: run one named experiment (trainer/bench/experiments.py)
and write its dated result file under docs/bench/: the question, hardware, versions, commit, the full
configuration and command, then the tool's report (tables, headline, timelines beside it).

    python -m trainer.bench.run schedule-vs-static                 # 4 GPUs, scenarios a, c (d with --corpus)
    python -m trainer.bench.run schedule-vs-static --gpus 2        # the same on 2 GPUs (PP=2)
    python -m trainer.bench.run schedule-vs-static --scenarios a   # one scenario per call (each < 10 min)
    python -m trainer.bench.run layouts
    python -m trainer.bench.run transport
    python -m trainer.bench.run schedule-vs-static --device cpu --results /tmp/r   # CPU dry run, tiny model

On CPU the model is ``tiny`` and PP is 2 unless given: graphed lines are listed as not run, the
megatron lines run our runtime's static orders (labelled so). Arguments after ``--`` go to the tool.
At the end the runner prints each scenario's headline (the three ratios: vs megatron-core's best eager
line, vs the best graphed static order, step vs the balanced limit).
Exit status: the tool's (0: every line ran), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.bench.experiments import EXPERIMENTS, MODELS, Experiment
from trainer.cli import OneLineParser
from trainer.launch.group_stop import stop_group

REPO = Path(__file__).resolve().parents[2]
REQUIRED_FIELDS = ("experiment", "question", "date", "hardware", "versions", "commit", "configuration", "command")
"""Rows of every result file's header table (tests/unit/test_bench_experiments.py holds the runner to it)."""


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m trainer.bench.run", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS), help="which experiment (trainer/bench/experiments.py)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs (the pipeline's PP without layouts); default: the experiment's, 2 on CPU")
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="default: the experiment's (e.g. gpt16-h2048), its CPU model (tiny) on CPU")
    parser.add_argument("--corpus", default="", help="GPT-2-tokenized corpus prefix for scenario d")
    parser.add_argument("--scenarios", default=None,
                        help="comma-separated subset of the experiment's scenarios to run in this call (default:"
                        " all of them); e.g. one per call where a call has a time limit")
    parser.add_argument("--out", type=Path, default=None, help="work folder (each line's logs); default /tmp/bench-NAME")
    parser.add_argument("--results", type=Path, default=REPO / "docs" / "bench",
                        help="where the dated result file and its PNGs go")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="stop the tool after this long (its whole process group) and still write the result"
                        " file from the lines it finished, saying so; for calls with a time limit (default: none)")
    parser.add_argument("--dry-plan", action="store_true", help="print the tool's command and the plan; write nothing")
    return parser


def as_run(tool: list[str], flag: str) -> list[str]:
    """What the tool runs for a comma-separated ``flag`` (--layouts, --lines): its last value, since flags
    after ``--`` may override the experiment's."""
    given = [tool[i + 1] if a == flag else a.split("=", 1)[1] for i, a in enumerate(tool)
             if (a == flag and i + 1 < len(tool)) or a.startswith(flag + "=")]
    return given[-1].split(",") if given else []


def layouts_as_run(tool: list[str]) -> list[str]:
    """The layouts the tool runs (:func:`as_run`)."""
    return as_run(tool, "--layouts")


def layouts_for(exp: Experiment, device: str) -> list[str]:
    """The experiment's layouts as this device runs them: on CPU a layout's own model (``4x1x1@NAME``)
    is replaced by its CPU stand-in (trainer/bench/experiments.py), as the call's model is by ``tiny``."""
    if device != "cpu":
        return list(exp.layouts)
    out = []
    for layout in exp.layouts:
        form, _, name = layout.partition("@")
        out.append(f"{form}@{MODELS[name].cpu_stand_in}" if name else layout)
    return out


def tool_command(exp: Experiment, device: str, gpus: int, model: str, corpus: str, out: Path,
                 report: Path, more: list[str], scenarios: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(argv of the tool, notes on what of the experiment was left out here). ``scenarios``: the
    subset to run (None: the experiment's)."""
    notes = []
    if exp.tool == "transport":
        argv = [sys.executable, "-m", "trainer.transport.bench", "--device", device, *exp.args,
                "--json", str(out / "transport.json")]
        if device == "cpu":  # a dry run: the two smallest sizes, two repeats
            argv[argv.index("--sizes") + 1] = "64K,1M"
            argv[argv.index("--repeats") + 1] = "2"
        return argv + more, notes
    scenarios = list(exp.scenarios if scenarios is None else scenarios)
    if "d" in scenarios and not corpus:
        scenarios.remove("d")
        notes.append("scenario d not run: no --corpus given")
    argv = [sys.executable, "-m", "trainer.bench.pipeline", "--device", device, *MODELS[model].bench_args(),
            "--lines", ",".join(exp.lines), "--scenarios", ",".join(scenarios), "--rounds", str(exp.rounds),
            "--out", str(out), "--report", str(report), *exp.args]
    if exp.layouts:
        argv += ["--layouts", ",".join(layouts_for(exp, device))]
    else:
        argv += ["--pipeline-parallel", str(gpus)]
    if corpus:
        argv += ["--corpus", corpus]
    if device == "cpu":
        argv += ["--line-timeout", "300", "--cpu-bind", "none", "--threads", "1"]  # a dry run on a small host
    return argv + more, notes


def run_tool(tool: list[str], capture: bool, time_limit: float | None) -> tuple[subprocess.CompletedProcess, str]:
    """Run the tool; past ``time_limit`` seconds stop its process group (the tool and the ranks it started:
    SIGTERM, SIGKILL 30 s later) so the caller can still write what it finished. (result, note or "")."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(tool, cwd=REPO, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=time_limit)
        return subprocess.CompletedProcess(tool, proc.returncode, out, err), ""
    except subprocess.TimeoutExpired:
        out, err = stop_group(proc, grace_s=30.0)
        note = (f"cut off by --time-limit {time_limit:.0f} s: the report holds only the lines finished before it"
                " (run the rest in another call, e.g. --scenarios or -- --lines)")
        print(f"[bench.run] {note}", flush=True)
        return subprocess.CompletedProcess(tool, 124, out or "", err or ""), note


def _git(*args: str, repo: Path = REPO, env: dict[str, str] | None = None) -> str:
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30,
                              env=env).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def commit(repo: Path = REPO) -> str:
    """The checkout's commit; with uncommitted changes, also the git tree the working tree would commit as
    (a scratch index: the checkout's own is untouched), which names the code that ran even where the
    checkout's history is older than its files (a copy of a newer tree on a lent machine):
    ``git log --format='%h %T' | grep TREE`` finds the commit whose files they are."""
    head = _git("rev-parse", "--short", "HEAD", repo=repo) or "unknown (not a git checkout)"
    if not _git("status", "--porcelain", "--untracked-files=no", repo=repo):
        return head
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        _git("read-tree", "HEAD", repo=repo, env=env)
        _git("add", "-A", repo=repo, env=env)
        tree = _git("write-tree", repo=repo, env=env)[:12]
    where = f" (working tree {tree}: git log --format='%h %T' | grep {tree})" if tree else ""
    return f"{head} with uncommitted changes{where}"


def hardware(device: str) -> tuple[str, str, dict[str, str]]:
    """(the hardware in words, its short name for the file name, versions)."""
    import os

    from trainer.measure.run_metrics import versions

    found = versions(device)
    if device == "cuda":
        import torch

        name, count = found.get("device_name", "?"), torch.cuda.device_count()
        short = (re.search(r"[A-Z]+[0-9]{2,}", name) or re.search(r"\w+", name or "gpu"))[0]
        return f"{count} x {name}", f"{count}x{short}", found
    return f"CPU, {os.cpu_count()} cores ({found.get('device_name', '?')})", "cpu", found


def result_path(folder: Path, day: str, name: str, short: str) -> Path:
    """``DATE-NAME-HARDWARE.md``, with -2, -3, ... where one exists already."""
    path, n = folder / f"{day}-{name}-{short}.md", 1
    while path.exists():
        n += 1
        path = folder / f"{day}-{name}-{short}-{n}.md"
    return path


def scenario_problems(exp: Experiment, text: str | None) -> tuple[list[str] | None, list[str]]:
    """(--scenarios as a list or None, problems naming the flag)."""
    if text is None:
        return None, []
    chosen = [s for s in text.split(",") if s]
    unknown = [s for s in chosen if s not in exp.scenarios]
    if unknown or not chosen:
        return None, [f"--scenarios={text!r}: {exp.name} runs scenarios {','.join(exp.scenarios)} (got "
                      f"{'unknown ' + ','.join(unknown) if unknown else 'none'})"]
    return chosen, []


def headline_lines(report_text: str) -> list[str]:
    """Each scenario's title and headline (the three ratios) from the tool's report."""
    out, title, in_headline = [], "", False
    for line in report_text.splitlines():
        if line.startswith("### ("):
            title = line
        in_headline = line.startswith("**Headline**") or (in_headline and bool(re.match(r"^[123]\. ", line)))
        if in_headline:
            out += [title] if title else []
            out.append(line)
            title = ""  # a scenario's title once, and none for a scenario that did not run
    return out


def header(exp: Experiment, when: datetime.datetime, hw: str, versions: dict[str, str], rev: str,
           model: str, gpus: int, command: str, tool: str, notes: list[str],
           scenarios: list[str] | None = None, layouts: list[str] | None = None,
           lines: list[str] | None = None) -> list[str]:
    """``layouts``, ``lines``: as run (:func:`as_run`; default, or empty: the experiment's)."""
    layouts = list(exp.layouts) if layouts is None else layouts
    lines = lines or list(exp.lines)
    configuration = (f"model **{model}** ({MODELS[model].describe()})" if exp.tool == "pipeline" else "") + (
        f"; lines {', '.join(lines)}; scenarios {', '.join(scenarios or exp.scenarios)}; rounds {exp.rounds}"
        if lines else "")
    configuration += f"; layouts {', '.join(layouts)}" if layouts else (f"; PP={gpus}" if exp.tool == "pipeline" else "")
    for name in dict.fromkeys(lay.partition("@")[2] for lay in layouts if "@" in lay):  # a layout's own model
        configuration += f"; @{name}: model **{name}** ({MODELS[name].describe()})"
    if exp.args:
        configuration += f"; tool flags `{shlex.join(exp.args)}`"
    version_text = ", ".join(f"{k} {v}" for k, v in versions.items() if k != "device_name")
    rows = [("experiment", f"`{exp.name}` (trainer/bench/experiments.py)"), ("question", exp.question),
            ("date", when.strftime("%Y-%m-%d %H:%M UTC")), ("hardware", hw), ("versions", version_text),
            ("commit", rev), ("configuration", configuration.lstrip("; ")), ("command", f"`{command}`"),
            ("tool command", f"`{tool}`")]
    out = [f"# {exp.name}, {when:%Y-%m-%d}", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return out + [""] + [f"- {n}" for n in notes] + ([""] if notes else [])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    cut = given.index("--") if "--" in given else len(given)  # the tool's own flags follow "--"
    args = parser.parse_args(given[:cut])
    args.tool_args = given[cut + 1:]
    exp = EXPERIMENTS[args.experiment]
    scenarios, problems = scenario_problems(exp, args.scenarios)
    if args.time_limit is not None and not args.time_limit > 0:
        problems.append(f"--time-limit={args.time_limit}: must be a number of seconds > 0")
    if problems:
        return parser.report("; ".join(problems))
    gpus = args.gpus or (2 if args.device == "cpu" else exp.gpus)
    model = args.model or (exp.cpu_model if args.device == "cpu" else exp.model)
    out = args.out or Path(f"/tmp/bench-{exp.name}")
    when = datetime.datetime.now(datetime.UTC)
    report = out / "report.md"
    tool, notes = tool_command(exp, args.device, gpus, model, args.corpus, out, report, args.tool_args, scenarios)
    command = shlex.join(["python", "-m", "trainer.bench.run", *given])
    if args.dry_plan:
        print(shlex.join(tool))
        if exp.tool == "pipeline":
            return subprocess.run([*tool, "--dry-plan"], cwd=REPO).returncode
        return 0
    hw, short, versions = hardware(args.device)
    out.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    # A subset of the scenarios is named in the file: two calls of one day (a, then c) write two files.
    subset = scenarios is not None and list(scenarios) != list(exp.scenarios)
    path = result_path(args.results, f"{when:%Y-%m-%d}", exp.name + ("-" + "".join(scenarios) if subset else ""),
                       short)
    # A report or timeline left in --out by an earlier run is not this run's: never copied as if it were.
    for stale in [report, *out.glob(f"{report.stem}.timeline-*.png")]:
        stale.unlink(missing_ok=True)
    print(f"[bench.run] {exp.name} on {hw}: {shlex.join(tool)}", flush=True)
    run, cut = run_tool(tool, exp.tool == "transport", args.time_limit)
    notes += [cut] if cut else []
    body: list[str] = []
    if exp.tool == "pipeline":
        text = report.read_text() if report.exists() else \
            f"# no report\n\nThe tool wrote no report (exit status {run.returncode}; see its output above).\n"
        for png in sorted(out.glob(f"{report.stem}.timeline-*.png")):  # beside the result, named after it
            target = path.with_name(f"{path.stem}.{png.name.removeprefix(report.stem + '.')}")
            target.write_bytes(png.read_bytes())
            text = text.replace(f"({png.name})", f"({target.name})")
        rest = text.splitlines()[1:]  # the report's own title goes: this file has one
        while rest and not rest[0].strip():
            rest.pop(0)
        body = ["## Report", ""] + [re.sub(r"^(#+) ", r"#\1 ", ln) for ln in rest]
        for line in headline_lines(text):
            print(f"[bench.run] {line}", flush=True)
    else:
        sys.stdout.write(run.stdout)
        sys.stderr.write(run.stderr)
        body = ["## Report", "", "```", run.stdout.rstrip(), "```"]
        if run.returncode:
            body += ["", f"Exit {run.returncode}; stderr tail:", "", "```", run.stderr[-2000:].rstrip(), "```"]
    head = header(exp, when, hw, versions, commit(), model, gpus, command, shlex.join(["python", *tool[1:]]), notes,
                  scenarios, layouts_as_run(tool), as_run(tool, "--lines"))
    path.write_text("\n".join(head + body) + "\n")
    print(f"[bench.run] wrote {path}", flush=True)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
