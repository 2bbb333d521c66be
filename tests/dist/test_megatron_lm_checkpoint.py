"""A torch_dist checkpoint Megatron-LM's save path wrote for the same model loads (CPU).

tests/dist/megatron_lm_save_harness.py writes, after iteration 3 of a 6-iteration run, a checkpoint as
Megatron-LM does (megatron-core's dist_checkpointing.save of its generate_state_dict: the model, the
optimizer's sharded state, the LR scheduler, its 'rng_state' object, Megatron-LM's common keys 'args',
'iteration', 'checkpoint_version' and 'content_metadata'; no 'mdpp' section).

- Full checkpoint, Adam, dropout on: resuming from it continues the original run (iterations 4-6 equal
  the straight run's within the equivalence tests' loss tolerance), which needs the Adam moments and the
  dropout RNG streams: without either (--no-load-optim, --no-load-rng) the losses differ.
- Weights only (Megatron-LM's --no-save-optim --no-save-rng): the losses of resuming from this trainer's
  own checkpoint with --no-load-optim --no-load-rng, and the log says what the checkpoint did not hold.
- An optimizer state this run cannot take (another --optimizer) is refused, naming the folder and what
  differs, before any shard is read.
- The distributed optimizer over DP=2 in Megatron-LM's default form (dp_reshardable): resumes under the
  same layout to the straight run's losses; under PP=2 x DP=1 it is refused, naming the pipeline size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.checkpoints import TRACKER
from tests.dist.launch import check_ok, launch
from tests.dist.test_checkpoint_layouts import ARGS, LOSS_RTOL, train

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _write(theirs: Path, *extra: str, ours: Path | None = None, harness: tuple[str, ...] = (), world: int = 1) -> None:
    """Train 6 iterations, writing the Megatron-LM checkpoint after 3 (and this trainer's at 3 and 6 into ``ours``)."""
    save = ["--save", str(ours), "--save-interval", "3"] if ours is not None else []
    check_ok(launch(["tests.dist.megatron_lm_save_harness", "--out", str(theirs), "--at", "3", *harness, "--",
                     *ARGS, *extra, *save], world, timeout_s=420))
    assert (theirs / TRACKER).read_text().strip() == "3"


@pytest.mark.timeout(1200)
def test_megatron_lm_checkpoint_resumes_with_its_optimizer_and_rng_state(tmp_path: Path) -> None:
    theirs = tmp_path / "megatron-lm"
    straight, _ = train(tmp_path / "straight", 1, *DROPOUT)  # the run the harness interrupts at 3
    _write(theirs, *DROPOUT)

    resumed, output = train(tmp_path / "resumed", 1, *DROPOUT, "--load", str(theirs))
    assert sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        assert resumed[it] == pytest.approx(straight[it], rel=LOSS_RTOL), (it, resumed[it], straight[it])
    assert f"{theirs / 'iter_0000003'} is a Megatron-LM checkpoint: loading its model weights, optimizer and " \
           "LR scheduler state, RNG states" in output, output[-3000:]

    # Without the Adam moments the step after the resume differs (the test can fail).
    fresh, output = train(tmp_path / "fresh", 1, *DROPOUT, "--load", str(theirs), "--no-load-optim")
    assert fresh[5] != pytest.approx(straight[5], rel=LOSS_RTOL)
    assert "loading its model weights, RNG states" in output
    # Without its RNG states the dropout masks of iteration 4 differ.
    other_masks, output = train(tmp_path / "no-rng", 1, *DROPOUT, "--load", str(theirs), "--no-load-rng")
    assert other_masks[4] != pytest.approx(straight[4], rel=LOSS_RTOL)
    assert "loading its model weights, optimizer and LR scheduler state" in output

    # Another optimizer: refused, naming the folder and the difference.
    refused = launch(["trainer.train", *ARGS, *DROPOUT, "--optimizer", "sgd", "--load", str(theirs)], 1,
                     timeout_s=300)[0]
    assert refused.returncode != 0 and "iteration        4/" not in refused.output
    assert (f"{theirs / 'iter_0000003'}: this Megatron-LM checkpoint's optimizer state does not fit this run's "
            "optimizer (--optimizer: checkpoint 'adam', this run 'sgd')") in refused.output, refused.output[-3000:]
    assert "--no-load-optim" in refused.output


@pytest.mark.timeout(900)
def test_megatron_lm_weights_only_checkpoint_loads_its_weights_and_iteration(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "megatron-lm"
    _write(theirs, ours=ours, harness=("--weights-only",))
    (ours / TRACKER).write_text("3\n")  # the run went on to 6; resume both from 3

    from_theirs, output = train(tmp_path / "a", 1, "--load", str(theirs))
    from_ours, _ = train(tmp_path / "b", 1, "--load", str(ours), "--no-load-optim", "--no-load-rng")
    assert sorted(from_theirs) == [4, 5, 6] and sorted(from_ours) == [4, 5, 6]
    assert from_theirs == pytest.approx(from_ours, rel=1e-6)
    assert f"resumed from {theirs / 'iter_0000003'} (iteration 3)" in output
    assert (f"{theirs / 'iter_0000003'} is a Megatron-LM checkpoint: loading its model weights; not its optimizer "
            "and LR scheduler state (saved with --no-save-optim) and RNG states (saved with --no-save-rng)") in output, \
        output[-3000:]


@pytest.mark.timeout(1200)
def test_megatron_lm_distributed_optimizer_state_resumes_under_its_own_layout(tmp_path: Path) -> None:
    theirs, dist_opt = tmp_path / "megatron-lm", ("--use-distributed-optimizer",)
    straight, _ = train(tmp_path / "straight", 2, *dist_opt)  # DP=2
    _write(theirs, *dist_opt, world=2)
    resumed, output = train(tmp_path / "resumed", 2, *dist_opt, "--load", str(theirs))
    assert sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        assert resumed[it] == pytest.approx(straight[it], rel=LOSS_RTOL), (it, resumed[it], straight[it])
    assert "loading its model weights, optimizer and LR scheduler state, RNG states" in output, output[-3000:]
    refused = launch(["trainer.train", *ARGS, *dist_opt, "--pipeline-model-parallel-size", "2", "--load", str(theirs)],
                     2, timeout_s=300)
    text = refused[0].output + refused[1].output
    assert any(r.returncode != 0 for r in refused) and "iteration        4/" not in text
    assert (f"{theirs / 'iter_0000003'}: this Megatron-LM checkpoint's optimizer state does not fit this run's "
            "optimizer (--pipeline-model-parallel-size: checkpoint 1, this run 2 (the distributed optimizer's "
            "'dp_reshardable' state loads under its own TP x PP layout only") in text, text[-3000:]
