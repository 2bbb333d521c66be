"""Submit a recipe's chain: preprocess -> train (afterok) -> aggregate (afterany).

    python -m workflows.submit gpt --nodes 2 --wait
    python -m workflows.submit bert --nodes 1 --gpus-per-node 4 --partition gpu --image ./mdpp.sqsh \
        --time 04:00:00 --account proj --qos high --sbatch-arg mail-type=END

Each step is a submitit job running its rendered sbatch file (workflows/submitit_chain.py);
--via sbatch submits the same files with plain `sbatch` instead. With --wait, a failed step's
state, exit code, log tail and remote traceback are printed, and the aggregation's summary.

Prints the job ids, the sacct command and the output folders. With --wait it shows each job's
state as it changes and exits 0 only when all three end COMPLETED (1 otherwise, 3 on timeout).
Bad input (unknown recipe, --nodes < 1 or above the partition's nodes, a missing data file or
image) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import time
from pathlib import Path

from trainer.problems import problems_text
from workflows import chain, jobs, local_chain, preflight, recipes, slurm, status, submitit_chain, sweep
from workflows.cli import OneLineParser, fail, parse_assignment
from workflows.render import REPO
from workflows.sbatch_params import SbatchParams, parse_pass_through

PROG = "python -m workflows.submit"
EXIT_FAILED = 1
EXIT_TIMEOUT = 3


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help=f"one of: {', '.join(recipes.RECIPES)}")
    parser.add_argument("--nodes", type=int, default=None, help="training nodes (default: the recipe's)")
    parser.add_argument("--gpus-per-node", type=int, default=0,
                        help="> 0 selects the recipe's GPU size and requests the GPUs (default: 0, CPU demo)")
    parser.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's)")
    parser.add_argument("--image", default=None, help="container image for Pyxis/enroot (default: host)")
    parser.add_argument("--train-iters", type=int, default=None, help="override TRAIN_ITERS")
    parser.add_argument("--env", type=parse_assignment, action="append", default=[], metavar="KEY=VALUE",
                        help="override any sbatch setting, e.g. --env NUM_LAYERS=8 (repeatable)")
    parser.add_argument("--runs-dir", type=Path, default=REPO / jobs.RUNS,
                        help="parent of the chain's output folder (default: runs/)")
    sbatch = parser.add_argument_group("sbatch parameters (validated together before anything is submitted)")
    sbatch.add_argument("--time", default=None, help="training job's time limit, e.g. 04:00:00 (default: 02:00:00)")
    sbatch.add_argument("--account", default=None, help="--account of every job")
    sbatch.add_argument("--qos", default=None, help="--qos of every job")
    sbatch.add_argument("--constraint", default=None, help="node features of the training job")
    sbatch.add_argument("--exclusive", action="store_true", help="whole nodes for training (always for GPU runs)")
    sbatch.add_argument("--mem", default=None, help="memory per training node, e.g. 0 (all) or 64G")
    sbatch.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per training rank (default 1)")
    sbatch.add_argument("--sbatch-arg", type=parse_pass_through, action="append", default=[], metavar="KEY[=VALUE]",
                        help="any other sbatch option for every job, e.g. mail-type=END (repeatable)")
    parser.add_argument("--nccl-debug", default=None, metavar="LEVEL",
                        help="NCCL_DEBUG for the training ranks (WARN, INFO, TRACE)")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="train once per value (repeatable: the cartesian product), e.g. --sweep pp=2,4 "
                             "--sweep schedule=1f1b,dpp: one preprocessing job, the runs as a job array, "
                             "one aggregation each (submitit only)")
    parser.add_argument("--via", choices=("submitit", "sbatch", *local_chain.VIAS), default="submitit",
                        help="submit through submitit (default) or plain sbatch, both running the same files; "
                             "or run the same steps on this machine without Slurm: local (submitit's "
                             "LocalExecutor) or debug (its DebugExecutor: in this process, pdb on a failure)")
    parser.add_argument("--wait", action="store_true", help="follow the chain until it finishes")
    parser.add_argument("--timeout", type=float, default=3600.0, help="--wait gives up after this many seconds")
    return parser


def image_reference(image: str | None) -> str | None:
    """A local .sqsh file as an absolute path (the jobs run elsewhere); registry names unchanged."""
    if image and Path(image).is_file():
        return str(Path(image).resolve())
    return image


def params_from_args(args: argparse.Namespace) -> SbatchParams:
    return SbatchParams(
        time=args.time, account=args.account, qos=args.qos, constraint=args.constraint,
        exclusive=args.exclusive, mem=args.mem, cpus_per_task=args.cpus_per_task,
        gpus_per_node=args.gpus_per_node, extra=dict(args.sbatch_arg),
    )


def spec_from_args(args: argparse.Namespace) -> tuple[chain.ChainSpec, SbatchParams]:
    """Validated ChainSpec and sbatch parameters; one ValueError naming every bad value otherwise."""
    spec, params, _runs = specs_from_args(args)
    return spec, params


def specs_from_args(
    args: argparse.Namespace,
) -> tuple[chain.ChainSpec, SbatchParams, list[tuple[sweep.Point, chain.ChainSpec]]]:
    """The chain's (or the sweep's preprocessing) spec, sbatch parameters and, with --sweep, one
    spec per run; all validated, one ValueError naming every bad value otherwise."""
    params = params_from_args(args)
    problems = params.problems()
    if args.train_iters is not None and args.train_iters < 1:
        problems.append(f"--train-iters {args.train_iters}: must be >= 1")
    overrides, alias_problems = jobs.apply_aliases(dict(args.env))
    problems += alias_problems
    if args.train_iters is not None:
        overrides["TRAIN_ITERS"] = str(args.train_iters)
    if args.nccl_debug:
        overrides["NCCL_DEBUG"] = args.nccl_debug
    axes, sweep_problems = sweep.parse(args.sweep, overrides)
    problems += sweep_problems
    if axes and args.via != "submitit":
        problems.append("--sweep needs --via submitit (the runs are one submitit job array)")
    local = args.via in local_chain.VIAS
    if local:
        problems += local_problems(args)
    spec = None
    runs: list[tuple[sweep.Point, chain.ChainSpec]] = []
    try:
        recipe = recipes.get(args.recipe, "gpu" if args.gpus_per_node > 0 else "cpu")
        run_dir = chain.new_run_dir(args.runs_dir.resolve(), recipe)
        if axes:  # every run reads the one dataset the sweep's preprocessing writes
            overrides.setdefault("DATA_PATH", str(run_dir / "data"))
        spec = chain.ChainSpec(
            recipe=recipe,
            nodes=(1 if local else recipe.nodes) if args.nodes is None else args.nodes,
            repo_dir=REPO,
            run_dir=run_dir,
            gpus_per_node=max(args.gpus_per_node, 0),
            partition=args.partition,
            image=image_reference(args.image),
            overrides=overrides,
        )
    except ValueError as exc:
        problems.append(str(exc))
    if spec is not None and axes and not any("more than" in p for p in sweep_problems):
        refused: dict[str, list[str]] = {}  # the same problem once, with every run it concerns
        for point in sweep.points(axes):
            # A bad value of an axis is named once above, not again for each run that has it.
            good = {k: v for k, v in point.overrides.items() if not jobs.value_problem(k, v)}
            try:
                runs.append((point, dataclasses.replace(spec, run_dir=spec.run_dir / point.label,
                                                        overrides={**overrides, **good})))
            except ValueError as exc:
                refused.setdefault(str(exc), []).append(point.description)
        problems += [f"--sweep run(s) {', '.join(which)}: {why}" for why, which in refused.items()]
    if spec is not None:
        missing = spec.missing_inputs()
        problems += [f"missing data file(s): {', '.join(missing)} (relative to {REPO})"] if missing else []
        # What only the filesystem and the cluster can tell, still before anything is submitted.
        problems += preflight.image_problems(args.image)
        problems += [] if local else preflight.partition_problems(spec.nodes, spec.partition)
        problems += preflight.runs_dir_problems(args.runs_dir.resolve())
    if problems or spec is None:
        raise ValueError(problems_text(problems))
    return spec, params, runs


LOCAL_UNUSED = ("IMAGE", "CONTAINER_MOUNTS", "CONTAINER_WORKDIR", "FSX_MOUNT")  # Pyxis's, in the sbatch files


def local_problems(args: argparse.Namespace) -> list[str]:
    """Options --via local/debug cannot honour: they are Slurm's (or Pyxis's), and this is one machine."""
    problems = []
    if args.nodes is not None and args.nodes != 1:
        problems.append(f"--nodes {args.nodes}: --via {args.via} runs on this one machine (--nodes 1)")
    slurm_only = {"--partition": args.partition, "--image": args.image, "--time": args.time,
                  "--account": args.account, "--qos": args.qos, "--constraint": args.constraint,
                  "--exclusive": args.exclusive, "--mem": args.mem, "--cpus-per-task": args.cpus_per_task,
                  "--sbatch-arg": args.sbatch_arg}
    given = [flag for flag, value in slurm_only.items() if value]
    given += [f"--env {key}" for key, _value in args.env if key in LOCAL_UNUSED]
    if given:
        problems.append(f"{', '.join(given)}: Slurm (or Pyxis) options, which --via {args.via} (no Slurm) "
                        "cannot honour")
    return problems


def run_local(spec: chain.ChainSpec, via: str, timeout_s: float) -> int:
    """--via local/debug: run the chain here, show each state change, then its table and summary."""
    print(f"run:        {spec.run_dir} (--via {via}: on this machine, without Slurm)")
    print(f"logs:       {spec.run_dir / 'logs'}")
    print(f"status:     python -m workflows.status {spec.run_dir}", flush=True)

    def show(record: slurm.JobRecord, step: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {step:<11} {record.job_id:>6} {record.state}", flush=True)

    records, summary = local_chain.run(spec, via, timeout_s, show)
    print(status.table(records))
    for line in chain.never_started(records):
        print(line)
    if summary is not None:
        print(submitit_chain.format_summary(summary))
    state, code = status.verdict(records)
    if code:
        for report in local_chain.failures(spec.run_dir):
            print(report, file=sys.stderr)
        print(f"chain {state}: logs in {spec.run_dir / 'logs'}", file=sys.stderr)
        return code
    print(f"chain {state}")
    return 0


def print_chain(submitted: chain.Chain) -> None:
    run = submitted.run_dir
    for step in chain.STEPS:
        print(f"{step:<11} job {submitted.job_ids[step]}")
    print(f"watch:      {shlex.join(slurm.sacct_command(submitted.ids))}")
    print(f"            python -m workflows.status {submitted.job_ids['train']}")
    print(f"logs:       {run / 'logs'}")
    print(f"dataset:    {run / 'data'}")
    print(f"checkpoint: {run / 'checkpoints'}")
    print(f"traces:     {run / 'traces'} (merged.json, summary.json, timeline.png after aggregation)")
    sys.stdout.flush()


def follow(submitted: chain.Chain, timeout_s: float,
           through: submitit_chain.SubmittedChain | None = None) -> int:
    """Show state changes until the chain ends; with submitit jobs, report failures and the summary."""
    def show(record: slurm.JobRecord, step: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {step:<11} {record.job_id:>6} {record.state}", flush=True)

    try:
        final = chain.wait(submitted, timeout_s, show)
    except TimeoutError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    records = dict(zip(chain.STEPS, final, strict=True))
    bad = {step: r for step, r in records.items() if r.state != "COMPLETED"}
    if through is not None:
        for step, record in bad.items():
            print(submitit_chain.failure_report(through, step, record), file=sys.stderr)
        if records["aggregate"].state == "COMPLETED":
            summary = submitit_chain.aggregation_result(through.jobs["aggregate"])
            print(submitit_chain.format_summary(summary or {}))
    if bad:
        described = "; ".join(f"{step} {r.job_id} {r.state} (exit {r.exit_code})" for step, r in bad.items())
        print(f"chain failed: {described}; logs in {submitted.run_dir / 'logs'}", file=sys.stderr)
        return EXIT_FAILED
    print("chain COMPLETED")
    return 0


def print_sweep(submitted: submitit_chain.SubmittedSweep) -> None:
    manifest = submitted.manifest
    print(f"sweep:      {submitted.sweep_dir} ({len(manifest['points'])} runs)")
    print(f"preprocess job {manifest['preprocess']}")
    for point in manifest["points"]:
        print(f"run {point['description']}: train job {point['train']}, aggregate job {point['aggregate']}, "
              f"folder {point['run_dir']}")
    print(f"watch:      python -m workflows.status {manifest['preprocess']} --runs-dir {submitted.sweep_dir.parent}")
    print(f"logs:       {manifest['logs']}")
    sys.stdout.flush()


def follow_sweep(submitted: submitit_chain.SubmittedSweep, timeout_s: float, poll_s: float = 2.0) -> int:
    """Show each job's state changes until the sweep ends, then its table (exit 0: all COMPLETED);
    each job that did not complete gets its state, exit code, log tail and remote traceback."""
    manifest = submitted.manifest
    names = {job_id: what for what, _step, job_id in sweep.jobs_of(manifest)}
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        records = sweep.query(manifest)
        for job_id, what in names.items():
            state = sweep.state_of(records, job_id)
            if seen.get(job_id) != state:
                seen[job_id] = state
                print(f"{time.strftime('%H:%M:%S')} {job_id:>8} {state:<10} {what}", flush=True)
        state = sweep.verdict(manifest, records)
        if state != "RUNNING":
            break
        if time.monotonic() > deadline:
            print(f"{PROG}: sweep not finished after {timeout_s:.0f} s", file=sys.stderr)
            return EXIT_TIMEOUT
        time.sleep(poll_s)
    print(sweep.table(manifest, records))
    for line in sweep.never_started(manifest, records):
        print(line)
    if state != "COMPLETED":
        for report in submitit_chain.sweep_failure_reports(manifest, records):
            print(report, file=sys.stderr)
        print(f"sweep failed: logs in {manifest['logs']}", file=sys.stderr)
        return EXIT_FAILED
    print("sweep COMPLETED")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        spec, params, runs = specs_from_args(args)
    except ValueError as exc:
        fail(str(exc), PROG)
    try:
        if args.via in local_chain.VIAS:
            return run_local(spec, args.via, args.timeout)
        if runs:
            swept = submitit_chain.submit_sweep(spec, runs, params)
            print_sweep(swept)
            return follow_sweep(swept, args.timeout) if args.wait else 0
        through = None
        if args.via == "submitit":
            through = submitit_chain.submit(spec, params)
            submitted = through.chain
        else:
            submitted = chain.submit(spec, params)
        print_chain(submitted)
        return follow(submitted, args.timeout, through) if args.wait else 0
    except slurm.SlurmError as exc:  # the cluster's problem, not the input's: status 1, one line
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:  # the run folder could not be written after all (a full or read-only disk)
        print(f"{PROG}: error: writing the run folder {spec.run_dir} failed: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
