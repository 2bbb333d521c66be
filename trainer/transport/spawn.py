"""Run a function on N local processes joined in a gloo process group (tests and the benchmark).

Processes come from a forkserver that has already imported torch, so each costs a fork rather than
a fresh interpreter and torch import (which matters on a 2-core CI machine). The group rendezvous
on a free loopback port found by binding port 0.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.ports import free_port


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
    outcomes = []
    for rank, (pipe, proc) in enumerate(zip(pipes, procs, strict=True)):
        remaining = max(deadline - time.monotonic(), 0.0)
        report: tuple[str, Any] | None = None
        if pipe.poll(remaining):
            try:
                report = pipe.recv()
            except EOFError:  # died without reporting (killed, os._exit)
                report = None
        proc.join(max(deadline - time.monotonic(), 0.0) if report is None else 10.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
            outcomes.append(Outcome(rank, error=f"rank {rank} still running after {timeout_s:.0f}s: killed", exitcode=proc.exitcode))
        elif report is None:
            outcomes.append(Outcome(rank, exitcode=proc.exitcode, error=f"rank {rank} exited with code {proc.exitcode} without a result"))
        elif report[0] == "error":
            outcomes.append(Outcome(rank, error=report[1], exitcode=proc.exitcode))
        else:
            outcomes.append(Outcome(rank, value=report[1], exitcode=proc.exitcode))
    return outcomes


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
