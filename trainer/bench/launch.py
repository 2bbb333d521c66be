"""Start one benchmark line: N processes on this host, the environment torchrun would give them.

Plain subprocesses rather than torchrun: no agent process or rendezvous store per line, so a line
starts as fast as its ranks import megatron-core. Each rank's output goes to ``rank<R>.log`` in the
line's folder; a line past its deadline is killed (all ranks), never left hanging.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.ports import free_port

CUDA_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set (unless already set) for every rank on CUDA: NVLink multicast stays off on the lent machines."""
FAILURE_GRACE_S = 15.0
"""After one rank fails, how long its peers get to finish before they are killed."""


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
              timeout_s: float, threads: int) -> LineRun:
    """``python -m module args`` on ``world_size`` ranks; waits for all of them or the deadline."""
    folder.mkdir(parents=True, exist_ok=True)
    port, start = free_port(), time.monotonic()
    procs, logs = [], []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_RUN_ID": f"bench{port}", "PYTHONWARNINGS": "ignore"}
        env.setdefault("OMP_NUM_THREADS", str(threads))
        if device == "cuda":
            for key, value in CUDA_ENV.items():
                env.setdefault(key, value)
        log = folder / f"rank{rank}.log"
        logs.append(log)
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=out,
                                          stderr=subprocess.STDOUT))
    deadline, timed_out, failed_at = start + timeout_s, False, None
    # Poll rather than wait rank by rank: when one rank fails its peers usually block in a
    # collective until NCCL's own timeout, so they get a short grace period, then are killed.
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > FAILURE_GRACE_S):
            timed_out = now > deadline
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    codes = [p.returncode for p in procs]
    bad = [c for c in codes if c != 0]
    return LineRun(bad[0] if bad else 0, time.monotonic() - start, logs, timed_out)
