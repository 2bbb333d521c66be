"""``--manual-gc``: the collections of a real 2-rank run are exactly Megatron-LM's schedule.

Each rank runs ``trainer.train.main`` under this module's harness (``python -m tests.dist.test_manual_gc
--out DIR -- <trainer flags>``), which records every garbage collection through ``gc.callbacks`` as
(iteration, generation, automatic collector on?) -- the iteration being the number of training steps
done when it ran -- until ManualGC.stop() hands the collector back at the end.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest

from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags

ARGS = [*model_flags(), "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "4", "--pipeline-model-parallel-size", "2", "--use-dpp",
        "--eval-interval", "2", "--eval-iters", "1", "--split", "90,10,0", "--dpp-timeout", "120"]


def _events(tmp_path: Path, flags: list[str], harness: tuple[str, ...] = ()) -> dict[int, list[list]]:
    results = launch(["tests.dist.test_manual_gc", "--out", str(tmp_path), *harness, "--", *ARGS, *flags], 2,
                     timeout_s=240)
    check_ok(results)
    for r in results:
        (tmp_path / f"log_rank{r.rank}.txt").write_text(r.output)
    return {rank: json.loads((tmp_path / f"gc_rank{rank}.json").read_text()) for rank in range(2)}


def _in_step_lines(tmp_path: Path) -> dict[int, str]:
    """Each rank's end-of-run line on the collections inside training steps (trainer.profiling.manual_gc.GcPauses)."""
    lines = {}
    for rank in range(2):
        found = [line for line in (tmp_path / f"log_rank{rank}.txt").read_text().splitlines()
                 if "garbage collection(s) ran inside training steps" in line]
        assert len(found) == 1, (rank, found)
        lines[rank] = found[0]
    return lines


@pytest.mark.timeout(300)
def test_manual_gc_collects_at_start_around_evaluation_and_every_interval(tmp_path: Path) -> None:
    for rank, events in _events(tmp_path, ["--manual-gc", "--manual-gc-interval", "3"]).items():
        manual = [(it, gen) for it, gen, automatic in events if not automatic]
        # start: full; iteration 2 and 4: full before and young generation after evaluation; 3: interval.
        assert manual == [(0, 2), (2, 2), (2, 0), (3, 2), (4, 2), (4, 0)], (rank, events)
        assert not [e for e in events if e[2] and e[0] > 0], (rank, events)  # no automatic one while training
    # ... so none ran inside a step: the scheduled ones (start, evaluation, interval) are between steps
    for rank, line in _in_step_lines(tmp_path).items():
        assert f"stage {rank}: 0 garbage collection(s) ran inside training steps" in line, line


@pytest.mark.timeout(300)
def test_collections_inside_steps_are_counted_in_the_end_of_run_line(tmp_path: Path) -> None:
    """Without --manual-gc, a full collection the harness forces inside each of the 4 steps (after the
    backward, before the optimizer) is counted; the line points to --manual-gc once one took >= 1 ms."""
    _events(tmp_path, [], ("--collect-in-step",))
    for line in _in_step_lines(tmp_path).values():
        counts = line.split("(generation 0/1/2: ")[1].split(")")[0].split("/")
        assert int(counts[2]) >= 4, line
        longest_ms = float(line.split("longest ")[1].split(" ms")[0])
        if abs(longest_ms - 1.0) > 0.05:  # the line prints 0.1 ms steps
            assert ("--manual-gc runs them between steps instead" in line) == (longest_ms > 1.0), line


@pytest.mark.timeout(300)
def test_no_manual_gc_eval_leaves_only_the_interval(tmp_path: Path) -> None:
    for rank, events in _events(tmp_path, ["--manual-gc", "--manual-gc-interval", "2", "--no-manual-gc-eval"]).items():
        assert [(it, gen) for it, gen, automatic in events if not automatic] == [(0, 2), (2, 2), (4, 2)], (rank, events)


def _harness(argv: list[str]) -> int:
    from trainer.profiling import manual_gc
    from trainer.train import TrainHooks, main

    split = argv.index("--")
    out = Path(argv[argv.index("--out") + 1])
    state = {"iteration": 0, "recording": True}
    events: list[list] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start" and state["recording"]:
            events.append([state["iteration"], info["generation"], gc.isenabled()])

    def after_step(iteration: int, _losses: dict) -> None:
        state["iteration"] = iteration

    def after_backward(_iteration: int, _model) -> None:  # inside the training step
        gc.collect()

    stop = manual_gc.ManualGC.stop

    def stop_recording(self) -> None:  # the end of training: the collector comes back on here
        state["recording"] = False
        stop(self)

    manual_gc.ManualGC.stop = stop_recording
    gc.callbacks.append(record)
    in_step = after_backward if "--collect-in-step" in argv[:split] else None
    code = main(argv[split + 1:], TrainHooks(after_step=after_step, after_backward=in_step))
    (out / f"gc_rank{os.environ['RANK']}.json").write_text(json.dumps(events))
    return code


if __name__ == "__main__":
    sys.exit(_harness(sys.argv[1:]))
