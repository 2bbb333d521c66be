"""``python -m tests.dist.crash_harness RANK ITERATION -- <trainer.train flags>``: one rank of a run in
which rank RANK raises right after ITERATION's step (a crash mid-training, as a bug or a bad batch
would cause). Everything else is the real ``trainer.train.main``."""

from __future__ import annotations

import os
import sys

from trainer.train import TrainHooks, main


class InjectedCrash(RuntimeError):
    """The crash under test."""


def _hooks(crash_rank: int, crash_iteration: int) -> TrainHooks:
    def after_step(iteration: int, losses: dict[str, float]) -> None:
        if int(os.environ["RANK"]) == crash_rank and iteration == crash_iteration:
            raise InjectedCrash(f"injected crash on rank {crash_rank} after iteration {iteration}")

    return TrainHooks(after_step=after_step)


if __name__ == "__main__":
    rank, iteration, separator, *train_args = sys.argv[1:]
    assert separator == "--", "usage: crash_harness RANK ITERATION -- <trainer.train flags>"
    sys.exit(main(train_args, _hooks(int(rank), int(iteration))))
