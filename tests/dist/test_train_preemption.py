"""SIGUSR1/SIGTERM: ranks agree at the next iteration boundary, save (Megatron-LM's layout, megatron-core torch_dist), and exit 75 (never 0: the run
did not finish); rank 0 records "checkpointed N" in $MDPP_EXIT_RECORD for the sbatch script, which
requeues on that record. A signal during start-up (before torch is even imported) means the same."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.dist.checkpoints import assert_megatron_checkpoint
from tests.dist.launch import start
from tests.model_flags import model_flags

EXIT_STOPPED = 75
ARGS = [*model_flags(), "--micro-batch-size", "2", "--global-batch-size", "4",
        "--pipeline-model-parallel-size", "2", "--use-dpp", "--train-iters", "100000"]


def assert_checkpointed_at(ckpt: Path, record: Path, results, at_least: int) -> int:
    outputs = results[0].output[-3000:] + results[1].output[-3000:]
    assert [r.returncode for r in results] == [EXIT_STOPPED, EXIT_STOPPED], outputs
    match = re.search(r"saved checkpoint at iteration (\d+) on signal", results[0].output)
    assert match, outputs
    saved = int(match.group(1))
    assert saved >= at_least
    assert_megatron_checkpoint(ckpt, saved)
    assert record.read_text() == f"checkpointed {saved}\n"
    return saved


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_to_one_rank_saves_on_all_ranks_and_exits_75(signum, tmp_path: Path) -> None:
    ckpt, record = tmp_path / "ckpt", tmp_path / "exit-record"
    ranks = start(["trainer.train", *ARGS, "--save", str(ckpt)], 2, extra_env={"MDPP_EXIT_RECORD": str(record)})
    deadline = time.monotonic() + 400
    # Rank 1 (last stage) logs iterations; signal only rank 0 once training is under way, so the
    # all-reduce of the flag is what makes rank 1 stop too.
    while "iteration        3/" not in ranks.output(1):
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.procs), ranks.output(1)[-3000:]
        time.sleep(0.2)
    ranks.procs[0].send_signal(signum)
    assert_checkpointed_at(ckpt, record, ranks.wait(120), at_least=3)


@pytest.mark.timeout(600)
def test_usr1_during_start_up_checkpoints_instead_of_killing(tmp_path: Path) -> None:
    """Before this fix the handler was installed after set-up: USR1 at start-up killed the rank."""
    ckpt, record, ready = tmp_path / "ckpt", tmp_path / "exit-record", tmp_path / "ready"
    ready.mkdir()
    ranks = start(["trainer.train", *ARGS, "--save", str(ckpt)], 2,
                  extra_env={"MDPP_EXIT_RECORD": str(record), "MDPP_READY_DIR": str(ready)})
    # The interpreter is up and the handlers are in (each rank marks itself ready right after, as the
    # sbatch script waits for); torch is still being imported. A fixed sleep raced the interpreter's
    # own start on a loaded host (both ranks died of USR1 before reaching trainer.launch.early_signals).
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < 2:
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.procs), list(ready.iterdir())
        time.sleep(0.01)
    for proc in ranks.procs:
        proc.send_signal(signal.SIGUSR1)
    assert_checkpointed_at(ckpt, record, ranks.wait(300), at_least=0)


@pytest.mark.timeout(600)
def test_finished_run_records_done(tmp_path: Path) -> None:
    record = tmp_path / "exit-record"
    args = [*ARGS[:-1], "3"]
    results = start(["trainer.train", *args], 2, extra_env={"MDPP_EXIT_RECORD": str(record)}).wait(300)
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:]
    assert record.read_text() == "done 3\n"
