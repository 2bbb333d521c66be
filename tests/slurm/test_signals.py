"""Every way a training job can be interrupted ends it requeued or non-zero, never COMPLETED early.

The training sbatch file is submitted by hand (as a user would) on the test run's tokenized corpus;
each job trains TRAIN_ITERS iterations and is interrupted in its own way:

* ``ranks-term``: ``scancel --signal=TERM`` reaches the ranks only. Before: they checkpointed and
  exited 0, and the job ended COMPLETED after a few of its iterations.
* ``usr1-start-batch`` / ``usr1-start-ranks``: USR1 to the batch shell as soon as it runs (its trap,
  set by the file's first lines, seen in /proc), long before srun, or to the ranks as soon as every
  one of them has its early handlers (its file in the job's ready folder), while they still import
  torch. Before: the ranks had no handler until set-up was done and died of it; the batch shell had
  no trap yet while it probed the node addresses. Now the shell's trap comes first and the ranks
  note the signal before importing torch. Both ends are waited out because no process can catch a
  signal there: the shell's own start, and a rank's interpreter start (a signal to the step before
  Slurm has started its tasks reaches nobody at all, and the job trains on as if never interrupted).
  Each of the three is a polite stop, asserted as such.

Whatever happens, a job that ends COMPLETED must have logged its last iteration; a requeued one is
released at once (tests/slurm/test_chain.py's release_when_held) and must then finish for real.

The jobs run at once (each with its own thread that interrupts and follows it, started by the first
test that asks): one after the other they spent most of their time starting Python and torch on one
core while the other idled. Only ``preempted`` runs alone, after the others have ended: its urgent
job takes both nodes whole, so Slurm would preempt every job beside it.

After the first periodic checkpoint (``SAVE_INTERVAL``) three more ways. Each job is requeued (sacct's
history: REQUEUED, then COMPLETED), resumes, logs the same losses as an uninterrupted run and leaves
no unfinished ``iter_*.tmp``:

* ``preempted``: a job of QOS ``urgent`` needs both nodes, and Slurm preempts the training job
  (PreemptMode=REQUEUE, scripts/cluster/slurm.conf.in; QOS normal's GraceTime, scripts/cluster.sh):
  TERM to the steps only, as ``scancel --signal=TERM`` sends. Before: the on-signal save died in
  megatron-core's checkpoint writer, whose helper process the TERM had killed too; FAILED. Now the
  ranks save on the signal and the batch shell requeues the job. Alone on the cluster the job trains faster than
  Slurm preempts, so its ranks are held (SIGSTOP) from the urgent job's submission until Slurm has
  preempted it: the TERM lands mid-training whatever the host's speed.
* ``requeue``: ``scontrol requeue``. Slurm ends the job itself: TERM to every process of it, the
  batch shell and srun included, and SIGKILL KillWait seconds later. srun answers its TERM with a
  SIGKILL of the step that slurmctld refuses for a job it is already ending, so the ranks have
  KillWait: they save on the signal inside it (the cluster's KillWait is what this case checks) and
  the job resumes right after the iteration saved. Before (KillWait=5, iterations of up to 30 s
  here): SIGKILL cut the save short and the iterations since the periodic checkpoint were lost.
* ``full-term``: ``scancel --full --signal=TERM``. The job keeps running, so srun's SIGKILL of the
  step goes through within milliseconds of its TERM, before any rank can save (srun's design: it
  answers TERM by killing its step; no setting changes that). Before: FAILED. Now the batch shell
  requeues the job and it resumes from the last periodic checkpoint: the iterations after it are run
  again, with the same losses. srun kills the ranks one after the other, so a rank that outlives its
  peer by a moment may log that peer's death (a TransportError and its traceback); that is the only
  error this case allows, and only before the restart. docs/workflows.md says which signal keeps what.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.slurm.test_chain import job_state, release_when_held, wait_until, wait_until_started
from workflows import slurm

REPO = Path(__file__).resolve().parents[2]
TRAIN_ITERS = 12
TIMEOUT_S = 600  # for a job to start, and then for each sign of progress (2 cores, the whole suite beside it)
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")


LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
PERIODIC_SAVE = re.compile(r"saved checkpoint at iteration (\d+) to ")
ON_SIGNAL_SAVE = re.compile(r"saved checkpoint at iteration (\d+) on signal")
DEAD_PEER = re.compile(r"TransportError: rank \d+: .* peer rank \d+ is probably dead")
"""The error a rank raises when its peer's links close under it (the traceback ends with it)."""
RAISED = re.compile(r"^\s*[\w.]+(?:Error|Exception): .*$", re.M)
"""The last line of a traceback: the exception raised."""


def losses(log: Path) -> dict[int, float]:
    """Iteration -> loss over every segment of a job (a resumed segment repeats no iteration the
    on-signal checkpoint kept, and any it repeats must match anyway: the last one is taken)."""
    return {int(i): float(loss) for i, loss in LOSS.findall(log.read_text())}


def last_iteration(log: Path | str) -> int:
    text = log if isinstance(log, str) else log.read_text() if log.exists() else ""
    return max((int(i) for i in ITERATION.findall(text)), default=0)


@pytest.fixture(scope="module")
def dataset(gpt2_corpus: str) -> Path:
    """The test run's tokenized corpus slice (tests/conftest.py), read by every job here: tokenizing
    a corpus of their own cost each module using it a preprocessing run (~5 s of CPU, a minute when
    the host is loaded)."""
    return Path(gpt2_corpus)


def submit_training(out: Path, dataset: Path, train_iters: int = TRAIN_ITERS) -> tuple[str, Path]:
    out.mkdir(parents=True)
    env = {**os.environ, "OUTPUT_DIR": str(out), "DATASET": str(dataset), "TRAIN_ITERS": str(train_iters),
           "SAVE_INTERVAL": "4"}
    job_id = slurm.sbatch(str(REPO / "sbatch" / "2.distributed-training.sbatch"),
                          ["--nodes=2", f"--output={out}/train_%j.out", f"--chdir={REPO}"], env)
    return job_id, out / f"train_{job_id}.out"


def wait_until_running(job_id: str) -> None:
    """The job's turn may take minutes while the rest of the suite holds the nodes: every wait for
    its progress starts after this one."""
    wait_until_started(job_id, TIMEOUT_S)


def follow_to_the_end(job_id: str, log: Path) -> tuple[str, int]:
    """Release the job whenever it is requeued; return its final state and how many restarts it had.
    Fails when neither the job's state nor its log changed for TIMEOUT_S."""
    restarts, seen = 0, None
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        shown = slurm.run(["scontrol", "show", "job", job_id]) if job_id else ""
        count = re.search(r"Restarts=(\d+)", shown)
        if count and int(count.group(1)) > restarts:
            restarts = int(count.group(1))
            release_when_held(job_id, timeout_s=TIMEOUT_S)
        state = job_state(job_id)
        if state in slurm.TERMINAL_STATES:
            return state, restarts
        progress = (state, restarts, log.stat().st_size if log.exists() else 0)
        if progress != seen:
            seen, deadline = progress, time.monotonic() + TIMEOUT_S
        time.sleep(1)
    raise AssertionError(f"job {job_id} ({seen[0]}, {restarts} restart(s)) made no progress for {TIMEOUT_S} s:\n"
                         f"{log.read_text()[-3000:] if log.exists() else '(no log)'}")


def history(job_id: str) -> list[str]:
    """The state of each run of the job, oldest first (sacct --duplicates)."""
    return slurm.run(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "--format=State"]).split()


def kill_wait() -> int:
    """The cluster's KillWait: the seconds between Slurm's TERM and its SIGKILL when it ends a job."""
    shown = re.search(r"^KillWait\s*=\s*(\d+)", slurm.run(["scontrol", "show", "config"]), re.M)
    assert shown, "scontrol show config names no KillWait"
    return int(shown.group(1))


def interrupt_after_a_periodic_save(kind: str, job_id: str, log: Path, out: Path) -> None:
    wait_until_running(job_id)

    def past_the_first_save() -> bool:
        text = log.read_text() if log.exists() else ""
        saved = PERIODIC_SAVE.search(text)
        return saved is not None and last_iteration(text) > int(saved.group(1))

    wait_until(past_the_first_save, TIMEOUT_S, "an iteration after the first periodic checkpoint", job_id)
    if kind in ("requeue", "full-term"):
        slurm.run({"requeue": ["scontrol", "requeue"], "full-term": ["scancel", "--full", "--signal=TERM"]}[kind]
                  + [job_id])
        return
    # Alone on the cluster the job's iterations take ~0.15 s, and its last one came before Slurm's
    # preemption did (~2 s after the urgent job's submission): the job ended as if never preempted.
    # Its ranks are held (SIGSTOP, as a slow iteration would hold them) until Slurm has preempted
    # it, so the TERM lands mid-training: held, a rank keeps the signal pending, and takes it as
    # soon as it runs again.
    held = rank_processes(job_id)
    assert len(held) >= 2, f"job {job_id}: found the processes {held} of its 2 ranks"
    try:
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        assert last_iteration(log) < TRAIN_ITERS, f"job {job_id} had finished before it was held:\n{log.read_text()}"
        # Both nodes, whole: only the training job's preemption makes room for it.
        urgent = slurm.run(["sbatch", "--parsable", "--qos=urgent", "--nodes=2", "--exclusive",
                            f"--output={out}/urgent_%j.out", "--wrap", "sleep 1"]).strip().split(";")[0]
        wait_until(lambda: preempted_at(job_id) is not None, TIMEOUT_S, f"the preemption (by job {urgent})", job_id)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    wait_until(lambda: job_state(urgent) in slurm.TERMINAL_STATES, TIMEOUT_S, f"the urgent job {urgent}")
    assert job_state(urgent) == "COMPLETED", job_state(urgent)


def job_processes(job_id: str, wanted: Callable[[bytes], bool]) -> Iterator[Path]:
    """/proc/<pid> of each process of job ``job_id`` whose command line (NUL-separated) is ``wanted``,
    the local cluster's nodes being this host."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if wanted((proc / "cmdline").read_bytes()) and \
                    f"SLURM_JOB_ID={job_id}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                yield proc
        except OSError:  # gone meanwhile, or not ours to read
            continue


def rank_processes(job_id: str) -> list[int]:
    """The training processes of job ``job_id``: its ranks, and any child they forked."""
    return [int(proc.name) for proc in job_processes(job_id, lambda cmd: b"trainer.train" in cmd.split(b"\0"))]


def preempted_at(job_id: str) -> str | None:
    """When Slurm preempted the job (scontrol's PreemptTime), or None while it has not."""
    shown = re.search(r"\bPreemptTime=(\S+)", slurm.run(["scontrol", "show", "job", job_id]))
    return shown.group(1) if shown and shown.group(1) not in ("None", "Unknown") else None


def batch_shell_traps(job_id: str, signum: int) -> bool:
    """Whether the job's batch shell runs and has set its trap for ``signum`` (the training file's
    first lines do): its SigCgt mask in /proc, the local cluster's nodes being this host. Until then
    the shell is still being started by slurmstepd, where the signal's default action ends the job:
    no file can trap a signal before its first line."""
    for proc in job_processes(job_id, lambda cmd: cmd.endswith(b"/slurm_script\0")):
        try:
            caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", (proc / "status").read_text(), re.M)
        except OSError:  # gone meanwhile
            continue
        return caught is not None and bool(int(caught.group(1), 16) >> (signum - 1) & 1)
    return False


def ranks_ready(job_id: str, log: Path) -> bool:
    """Whether every rank of the training step has its early USR1/TERM handlers in place: each leaves a
    file in the job's ready folder (trainer/launch/early_signals.py) before it imports torch. A signal to
    the step before its tasks exist reaches no process (Slurm signals the tasks it has started), and the
    job then trains to the end as if never interrupted; before a rank's handlers, the default action
    ends it."""
    ranks = re.search(r"^train: .* (\d+) ranks, ", log.read_text(), re.M)
    ready = log.parent / f".train-ready-{job_id}"
    return ranks is not None and ready.is_dir() and len(list(ready.iterdir())) >= int(ranks.group(1))


def interrupt(kind: str, job_id: str, log: Path) -> None:
    wait_until_running(job_id)
    if kind == "usr1-start-batch":  # the batch shell, before srun exists
        wait_until(lambda: batch_shell_traps(job_id, signal.SIGUSR1), TIMEOUT_S, "the batch shell's USR1 trap",
                   job_id)
        slurm.run(["scancel", "--batch", "--signal=USR1", job_id])
        return
    if kind == "usr1-start-ranks":  # the ranks, as soon as they catch it (still importing torch)
        wait_until(lambda: log.exists() and "restart 0" in log.read_text(), TIMEOUT_S, "the srun line", job_id)
        wait_until(lambda: ranks_ready(job_id, log), TIMEOUT_S, "every rank's early signal handlers", job_id)
        slurm.run(["scancel", "--signal=USR1", job_id])
        return
    wait_until(lambda: last_iteration(log) >= 3, TIMEOUT_S, "iteration 3", job_id)
    slurm.run(["scancel", "--signal=TERM", job_id])  # ranks-term


EARLY = ("ranks-term", "usr1-start-batch", "usr1-start-ranks")
AFTER_A_SAVE = ("preempted", "requeue", "full-term")
ALONE = ("preempted",)  # its urgent job needs both nodes whole: run beside others, it would preempt them too
UNINTERRUPTED = "uninterrupted"


class Job(threading.Thread):
    """One training job of this module: submitted when made; the thread interrupts it as ``kind`` says
    (not at all for UNINTERRUPTED) and follows it to the end."""

    def __init__(self, kind: str, out: Path, dataset: Path):
        super().__init__(daemon=True, name=f"signals-{kind}")
        self.kind, self.out = kind, out
        self.job_id, self.log = submit_training(out / "run", dataset)
        self.outcome: tuple[str, int] | None = None  # follow_to_the_end's (final state, restarts)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.kind in EARLY:
                interrupt(self.kind, self.job_id, self.log)
            elif self.kind in AFTER_A_SAVE:
                interrupt_after_a_periodic_save(self.kind, self.job_id, self.log, self.out)
            self.outcome = follow_to_the_end(self.job_id, self.log)
        except BaseException as exc:  # re-raised by the test in the main thread
            self.error = exc

    def finish(self, timeout_s: float) -> tuple[str, int]:
        self.join(timeout_s)
        assert not self.is_alive(), f"job {self.job_id} ({self.kind}) still followed after {timeout_s:.0f} s"
        if self.error is not None:
            raise self.error
        return self.outcome

    def cancel_if_running(self) -> None:
        if job_state(self.job_id) not in slurm.TERMINAL_STATES:
            slurm.call(["scancel", self.job_id])


@pytest.fixture(scope="module")
def jobs(dataset, tmp_path_factory) -> dict[str, Job]:
    """Every job of this module but ALONE, submitted at once, each followed by its own thread."""
    started = {kind: Job(kind, tmp_path_factory.mktemp(kind), dataset)
               for kind in (UNINTERRUPTED, *EARLY, *AFTER_A_SAVE) if kind not in ALONE}
    for job in started.values():
        job.start()
    yield started
    for job in started.values():
        job.cancel_if_running()


@pytest.mark.timeout(TIMEOUT_S * 4)
@pytest.mark.parametrize("kind", EARLY)
def test_an_interrupted_training_job_is_never_completed_early(kind, jobs):
    job = jobs[kind]
    job_id, log = job.job_id, job.log
    state, restarts = job.finish(TIMEOUT_S * 4 - 60)
    text = log.read_text()
    if state == "COMPLETED":
        assert last_iteration(log) == TRAIN_ITERS, text[-4000:]
        assert restarts >= 1, text[-4000:]  # it only completed through a requeue
    # Each is a polite stop: checkpoint, requeue, resume, finish ...
    assert (state, "on signal" in text) == ("COMPLETED", True), f"{state}\n{text[-4000:]}"
    # ... the batch shell's own requeue, of a plain job by its id (an array task's:
    # tests/slurm/test_sweep_arrays.py)
    assert f"requeueing job {job_id} to resume" in text, text[-4000:]


@pytest.fixture(scope="module")
def uninterrupted_losses(jobs) -> dict[int, float]:
    job = jobs[UNINTERRUPTED]
    state, restarts = job.finish(TIMEOUT_S * 4)
    assert (state, restarts) == ("COMPLETED", 0), job.log.read_text()[-4000:]
    found = losses(job.log)
    assert sorted(found) == list(range(1, TRAIN_ITERS + 1)), job.log.read_text()[-4000:]
    return found


@pytest.mark.timeout(TIMEOUT_S * 8)
@pytest.mark.parametrize("kind", AFTER_A_SAVE)
def test_a_signal_after_a_periodic_checkpoint_requeues_and_loses_nothing(kind, dataset, jobs, uninterrupted_losses,
                                                                        tmp_path):
    if kind in ALONE:  # only once every other job of the module has ended (their own tests report them)
        for other in jobs.values():
            other.join(TIMEOUT_S * 4)
            other.cancel_if_running()
        job = Job(kind, tmp_path, dataset)
        job.start()
    else:
        job = jobs[kind]
    job_id, log = job.job_id, job.log
    try:
        state, restarts = job.finish(TIMEOUT_S * 6)
    finally:
        job.cancel_if_running()
    text = log.read_text()
    assert (state, restarts) == ("COMPLETED", 1), f"{state} after {restarts} restart(s)\n{text[-5000:]}"
    runs = history(job_id)  # a preempted job requeues itself inside its grace time: REQUEUED as well
    assert runs == ["REQUEUED", "COMPLETED"], (runs, text[-5000:])
    first_run, _, second_run = text.partition(", restart 1\n")
    assert "Traceback" not in second_run and "BrokenPipeError" not in text, text[-5000:]
    if kind == "full-term":  # srun SIGKILLs the ranks one after the other: a survivor may report the dead peer
        raised = RAISED.findall(first_run)
        assert ("Traceback" in first_run) == bool(raised), first_run[-5000:]
        assert all(DEAD_PEER.search(line) for line in raised), (raised, first_run[-5000:])
    else:
        assert "Traceback" not in first_run, first_run[-5000:]
    periodic = [int(i) for i in PERIODIC_SAVE.findall(first_run)]
    resumed_at = min(int(i) for i in ITERATION.findall(second_run))
    saved = ON_SIGNAL_SAVE.search(first_run)
    if kind == "full-term":  # srun SIGKILLed the ranks: what came after the last periodic save is run again
        assert saved is None and "SIGTERM reached srun too" in first_run, first_run[-5000:]
        assert resumed_at == max(periodic) + 1 <= last_iteration(first_run), (periodic, first_run[-3000:])
    else:  # saved on the signal, within KillWait for `requeue`: nothing after the periodic save is lost
        assert saved and int(saved.group(1)) > periodic[0], f"KillWait={kill_wait()}\n{first_run[-5000:]}"
        assert resumed_at == int(saved.group(1)) + 1, second_run[-3000:]
    leftovers = sorted(p.name for p in (job.out / "run" / "checkpoints").iterdir() if p.name.endswith(".tmp"))
    assert leftovers == [], leftovers
    got = losses(log)
    assert sorted(got) == sorted(uninterrupted_losses)
    assert all(math.isclose(got[i], uninterrupted_losses[i], rel_tol=1e-5) for i in got), (got, uninterrupted_losses)
