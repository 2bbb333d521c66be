"""``python -m tests.dist.setup_loss_harness VICTIM -- <trainer.train flags>``: the real
``trainer.train.main`` on every rank; rank VICTIM SIGKILLs itself in the middle of the set-up, right
after the ranks agreed on the run token (every rank prints ``TOKEN <token>`` then), so its peers are
left waiting in the set-up's next collective. Only the injection point is patched; the processes,
the process group and the death are real."""

from __future__ import annotations

import os
import signal
import sys

from trainer.session import build
from trainer.train import main


def inject(victim: int) -> None:
    agreed = build.agreed_run_token

    def agreed_then_die(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        token = agreed(*args, **kwargs)
        print("TOKEN", token, flush=True)
        if int(os.environ["RANK"]) == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return token

    build.agreed_run_token = agreed_then_die


if __name__ == "__main__":
    victim, separator, *train_args = sys.argv[1:]
    assert separator == "--", "usage: setup_loss_harness VICTIM -- <trainer.train flags>"
    inject(int(victim))
    sys.exit(main(train_args))
