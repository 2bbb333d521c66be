"""Start N local ranks: the one launcher of the benchmarks and of the tests.

Two ways, both bounded by a deadline past which every rank still running is killed (never left hanging):

- :func:`start_ranks` / :func:`run_ranks`: ``python -m <module>`` per rank, as plain subprocesses with
  the environment torchrun would give them. No agent process or rendezvous store, so ranks start as
  fast as they import megatron-core. Rank R's output goes to ``rank<R>.log`` in a folder. The pipeline
  benchmark (trainer/bench/pipeline.py) runs its lines so, the training tests their ranks
  (tests/dist/launch.py adds the tests' defaults).
- :func:`run_processes`: a function on N processes joined in a gloo group. They come from a
  forkserver that has already imported torch, so each costs a fork rather than a fresh interpreter
  and torch import (which matters on a 2-core CI machine). The transport benchmark
  (trainer/transport/bench.py) and the transport tests run so.

Not test tooling: both benchmarks are user commands that start their own ranks. It sits beside the
trainer's leaves (it imports only trainer.launch.ports, trainer.launch.cpu_binding, trainer.launch.shm_segments
and trainer.names, and torch only inside a forked rank), so the two benchmarks, which nothing else in
trainer imports, can share it and the import graph stays a tree; the training runtime never imports it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.launch.cpu_binding import format_cpu_list
from trainer.launch.ports import free_port
from trainer.launch.shm_segments import unlink_segments
from trainer.names import is_segment_of_prefix, token_prefix

CUDA_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set (unless already set) for every benchmark rank on CUDA: NVLink multicast stays off on the lent machines."""
FAILURE_GRACE_S = 15.0
"""After one benchmark rank fails, how long its peers get to finish before they are killed."""


# ---- python -m <module> per rank ----------------------------------------------------------------
@dataclass
class Ranks:
    """Running ``python -m`` ranks; :meth:`wait` always returns."""

    procs: list[subprocess.Popen]
    logs: list[Path]
    started: float
    token_prefix: str = ""
    """What the ranks' run token begins with (trainer.names.token_prefix of their environment)."""

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace") if self.logs[rank].exists() else ""

    def wait(self, timeout_s: float, failure_grace_s: float | None = None) -> bool:
        """Wait for every rank; kill those still running ``timeout_s`` from now or, with
        ``failure_grace_s``, that long after the first rank failed. True when the deadline struck."""
        deadline, failed_at = time.monotonic() + timeout_s, None
        # Poll rather than wait rank by rank: when one rank fails its peers usually block in a
        # collective until their own timeout, so a grace period can cut that short.
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in self.procs):
                failed_at = now
            if now > deadline or (failure_grace_s is not None and failed_at is not None
                                  and now - failed_at > failure_grace_s):
                break
            time.sleep(0.2)
        timed_out = any(p.poll() is None for p in self.procs) and time.monotonic() > deadline
        killed = [rank for rank, proc in enumerate(self.procs) if proc.poll() is None]
        for rank in killed:
            self.procs[rank].kill()
            self.procs[rank].wait()
        if killed:
            self._remove_run_segments(killed)
        return timed_out

    def _remove_run_segments(self, killed: list[int]) -> None:
        """Remove what the run left in /dev/shm once ranks had to be killed: a SIGKILLed rank cannot
        unlink its own, and when every rank was killed no survivor does it for them. Only segments of
        a run token drawn from this launch's prefix (never another run's); said in rank 0's log."""
        if not self.token_prefix:
            return
        removed = unlink_segments(lambda name: is_segment_of_prefix(self.token_prefix, name))
        if removed:
            with open(self.logs[0], "a") as log:
                log.write(f"[launcher] killed rank(s) {', '.join(map(str, killed))}; removed their run's "
                          f"shared-memory segment(s): {', '.join(sorted(removed))}\n")


def start_ranks(module_args: list[str], world_size: int, folder: Path, *, run_id: str,
                env: dict[str, str] | None = None, local_world_size: int | None = None,
                cwd: Path | None = None, cpu_sets: list[list[int]] | None = None) -> Ranks:
    """Start ``python -m <module_args>`` on ``world_size`` ranks with torchrun's variables (RANK,
    WORLD_SIZE, LOCAL_*, MASTER_* on a free loopback port, TORCHELASTIC_RUN_ID ``<run_id><port>``);
    ``env`` goes on top of those. ``cpu_sets[r]``: the CPUs rank r may run on (set before it starts)."""
    folder.mkdir(parents=True, exist_ok=True)
    port, started = free_port(), time.monotonic()
    procs, logs, prefix = [], [], ""
    for rank in range(world_size):
        rank_env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(local_world_size or world_size), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"{run_id}{port}",
                    "PYTHONWARNINGS": "ignore", **(env or {})}
        prefix = token_prefix(rank_env)
        log = folder / f"rank{rank}.log"
        logs.append(log)
        cpus = cpu_sets[rank] if cpu_sets else None
        with open(log, "w") as out:
            if cpus:
                out.write(f"[launcher] rank {rank} bound to CPUs {format_cpu_list(cpus)}\n")
                out.flush()
            procs.append(subprocess.Popen([sys.executable, "-m", *module_args], cwd=cwd, env=rank_env,
                                          stdout=out, stderr=subprocess.STDOUT,
                                          preexec_fn=(lambda c=cpus: os.sched_setaffinity(0, c)) if cpus else None))
    return Ranks(procs, logs, started, prefix)


@dataclass
class LineRun:
    returncode: int
    """0 when every rank exited 0; the first non-zero code otherwise (-9 when killed at the deadline)."""
    seconds: float
    logs: list[Path]
    timed_out: bool = False

    def tail(self, lines: int = 25) -> str:
        """The end of the first failing rank's log (or rank 0's)."""
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            if "Traceback" in text or "error" in text.lower() or log is self.logs[-1]:
                return "\n".join(text.splitlines()[-lines:])
        return ""


def run_ranks(module: str, args: list[str], world_size: int, folder: Path, device: str,
              timeout_s: float, threads: int, cpu_sets: list[list[int]] | None = None) -> LineRun:
    """One benchmark line: ``python -m module args`` on ``world_size`` ranks; waits for all of them,
    the deadline, or FAILURE_GRACE_S after a rank failed. ``cpu_sets[r]``: the CPUs of rank r
    (trainer.launch.cpu_binding.numa_cpu_sets; written at the top of each rank's log); None: unbound."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    if device == "cuda":
        env |= {key: os.environ.get(key, value) for key, value in CUDA_ENV.items()}
    ranks = start_ranks([module, *args], world_size, folder, run_id="bench", env=env, cpu_sets=cpu_sets)
    timed_out = ranks.wait(timeout_s, FAILURE_GRACE_S)
    bad = [p.returncode for p in ranks.procs if p.returncode != 0]
    return LineRun(bad[0] if bad else 0, time.monotonic() - ranks.started, ranks.logs, timed_out)


# ---- a function per rank, in forked processes ------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """How one rank ended: its return value, the traceback of its exception, or its exit code."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


def run_processes(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0, backend: str = "gloo"
) -> list[Outcome]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; one Outcome per rank.

    ``fn`` must be importable by name (a module-level function). Ranks still running after
    ``timeout_s`` are killed and reported with ``error`` saying so; the call itself never hangs.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "trainer.transport"])
    port = free_port()
    pipes, procs = [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child, args=(fn, rank, world_size, port, backend, timeout_s, child_end, args),
            name=f"mdpp-rank{rank}",
        )  # fmt: skip
        proc.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(proc)
    deadline = time.monotonic() + timeout_s
    return [_outcome(rank, pipe, proc, deadline, timeout_s)
            for rank, (pipe, proc) in enumerate(zip(pipes, procs, strict=True))]


def _outcome(rank: int, pipe, proc, deadline: float, timeout_s: float) -> Outcome:  # noqa: ANN001
    report: tuple[str, Any] | None = None
    if pipe.poll(max(deadline - time.monotonic(), 0.0)):
        try:
            report = pipe.recv()
        except EOFError:  # died without reporting (killed, os._exit)
            report = None
    proc.join(max(deadline - time.monotonic(), 0.0) if report is None else 10.0)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return Outcome(rank, error=f"rank {rank} still running after {timeout_s:.0f}s: killed", exitcode=proc.exitcode)
    if report is None:
        return Outcome(rank, exitcode=proc.exitcode, error=f"rank {rank} exited with code {proc.exitcode} without a result")
    if report[0] == "error":
        return Outcome(rank, error=report[1], exitcode=proc.exitcode)
    return Outcome(rank, value=report[1], exitcode=proc.exitcode)


def check_all_ok(outcomes: list[Outcome]) -> list[Any]:
    """The ranks' return values; AssertionError with every failing rank's traceback otherwise."""
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise AssertionError("\n".join(f"--- rank {o.rank} (exit {o.exitcode}):\n{o.error}" for o in failed))
    return [o.value for o in outcomes]


def _child(fn, rank, world_size, port, backend, timeout_s, pipe, args) -> None:  # noqa: ANN001
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
        value = fn(rank, world_size, *args)
        pipe.send(("ok", value))
    except BaseException:  # report everything, including SystemExit from a test helper
        pipe.send(("error", traceback.format_exc()))
    pipe.close()
    # Skip interpreter teardown: destroying process groups can wait on peers that a test killed.
    os._exit(0)
