"""Show a chain's jobs from sacct, given any one of its job ids.

    python -m workflows.status 42

The chain's jobs share a name stem (mdpp-<run>-preprocess/-train/-aggregate, set by
workflows.submit), so one id finds the other two, including a job cancelled by a failed dependency
before it ever ran. A job submitted by hand with sbatch is shown alone, said to be no chain. Exit
status: 0 all COMPLETED, 1 any job ended otherwise, 3 still pending or running, 2 bad input (not a
job id, a job sacct does not know, such as 0).

A chain run on one machine by `workflows.submit --via local/debug` is shown from its run folder
(``python -m workflows.status runs/gpt-...``), read from the folder's local.json.

A sweep's job (named mdppsweep-<folder>-<step> by `workflows.submit --sweep`) shows the whole sweep
as a table — configuration, training job and state, aggregation state, ms/iteration and bubble from
each run's summary.json — read from <runs-dir>/<folder>/sweep.json (--runs-dir: the submit's, default
runs/). Array task ids (12_1) are accepted. A sweep with a failed run also prints, for each job
that did not complete, its state, exit code, log tail and the remote traceback submitit pickled.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from workflows import chain, jobs, local_chain, slurm, sweep
from workflows.cli import OneLineParser, fail
from workflows.render import REPO

PROG = "python -m workflows.status"
EXIT_FAILED, EXIT_RUNNING = 1, 3


def chain_records(job_id: str) -> list[slurm.JobRecord]:
    """The chain containing ``job_id`` in chain order; ValueError when sacct does not know it."""
    # Only the record of that very id: `sacct -j 0` lists every job, whose first would otherwise be
    # taken for job 0 and its chain shown.
    found = slurm.query(job_ids=sweep.query_ids([job_id]))
    own = [r for r in found if r.job_id == job_id or r.job_id.startswith(f"{job_id}_")][:1]
    if not own and len(found) == 1 and re.fullmatch(r"\d+_\d+", found[0].job_id):
        own = found  # an array task's own id: sacct shows it as <array id>_<task>
    if not own and "_" in job_id:  # a task that never ran: only its array's line 12_[0-1] exists
        task = sweep.record_of(sweep.records_by_id(found), job_id)
        own = [task] if task else []
    if not own:
        raise ValueError(f"job {job_id}: not found in sacct")
    names = chain.chain_names(own[0].name)
    if names is None:
        return own
    by_name = {r.name: r for r in slurm.query(names=names)}  # later runs of a name replace earlier ones
    return [by_name[n] for n in names if n in by_name]


def table(records: list[slurm.JobRecord]) -> str:
    rows = [("JobID", "JobName", "State", "ExitCode", "Elapsed", "NodeList")]
    rows += [(r.job_id, r.name, r.state, r.exit_code, r.elapsed, r.nodes) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def verdict(records: list[slurm.JobRecord]) -> tuple[str, int]:
    if not all(r.finished for r in records):
        return "RUNNING", EXIT_RUNNING
    if all(r.state == "COMPLETED" for r in records):
        return "COMPLETED", 0
    return "FAILED", EXIT_FAILED


def show_sweep(manifest_path: Path) -> int:
    """Print a sweep's table; its exit status like a chain's. ValueError without its manifest."""
    if not manifest_path.is_file():
        raise ValueError(f"a sweep job, but {manifest_path} does not exist: pass the submit's --runs-dir")
    manifest = sweep.read_manifest(manifest_path)
    records = sweep.query(manifest)
    print(sweep.table(manifest, records))
    for line in sweep.never_started(manifest, records):
        print(line)
    state = sweep.verdict(manifest, records)
    if any(r.finished and r.state != "COMPLETED" for r in records.values()):  # even while others run
        from workflows import submitit_chain  # submitit only where a report needs its pickles

        for report in submitit_chain.sweep_failure_reports(manifest, records):
            print(report)
    print(f"sweep: {state}")
    return {"RUNNING": EXIT_RUNNING, "COMPLETED": 0}.get(state, EXIT_FAILED)


def show_local(run_dir: Path) -> int:
    """A chain run by `submit --via local/debug`: its steps from local.json, as a Slurm chain's."""
    records = local_chain.records_of(local_chain.read_manifest(run_dir))
    print(table(records))
    for line in chain.never_started(records):
        print(line)
    state, code = verdict(records)
    print(f"chain: {state} (--via {local_chain.read_manifest(run_dir)['via']}, on this machine)")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("job_id", help="any job id of the chain or sweep, or the run folder of a chain run "
                                       "with submit --via local/debug")
    parser.add_argument("--runs-dir", type=Path, default=REPO / jobs.RUNS,
                        help="where the sweep's folder is (submit's --runs-dir; default: runs/)")
    args = parser.parse_args(argv)
    if (Path(args.job_id) / local_chain.MANIFEST).is_file():
        return show_local(Path(args.job_id))
    match = re.fullmatch(r"(\d+)(_\d+)?", args.job_id)
    if not match:
        fail(f"job id {args.job_id!r}: expected a number", PROG)
    job_id = str(int(match.group(1))) + (match.group(2) or "")  # sacct prints 7 for 007
    try:
        records = chain_records(job_id)
        name = sweep.sweep_of(records[0].name)
        if name is not None:
            return show_sweep(args.runs_dir / name / sweep.MANIFEST)
    except ValueError as exc:
        fail(str(exc), PROG)
    except slurm.SlurmError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(table(records))
    state, code = verdict(records)
    if len(records) == len(chain.STEPS):
        for line in chain.never_started(records):
            print(line)
    if chain.chain_names(records[0].name) is None:
        print(f"job {job_id}: {state} (not a workflows.submit chain: shown alone)")
    else:
        print(f"chain: {state}")
    return code


if __name__ == "__main__":
    sys.exit(main())
