"""A torch_dist checkpoint Megatron-LM's save path wrote for the same model loads (CPU, one rank).

tests/dist/megatron_lm_save_harness.py writes, after iteration 3, the model as Megatron-LM does
(megatron-core's dist_checkpointing.save of its sharded_state_dict with Megatron-LM's common keys
'args', 'iteration', 'checkpoint_version'; no optimizer, scheduler, RNG or 'mdpp' section), beside
this trainer's own checkpoint of the same iteration. Resuming from the Megatron-LM one must give the
losses of resuming from this trainer's with --no-load-optim --no-load-rng (the same weights, samples
from the checkpoint's consumed samples on, a fresh optimizer), and say what it did not load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.checkpoints import TRACKER
from tests.dist.launch import check_ok, launch
from tests.dist.test_checkpoint_layouts import ARGS, train


@pytest.mark.timeout(900)
def test_megatron_lm_torch_dist_checkpoint_loads_its_weights_and_iteration(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "megatron-lm"
    check_ok(launch(["tests.dist.megatron_lm_save_harness", "--out", str(theirs), "--at", "3", "--", *ARGS,
                     "--save", str(ours), "--save-interval", "3"], 1, timeout_s=420))
    (ours / TRACKER).write_text("3\n")  # the run went on to 6; resume both from 3
    assert (theirs / TRACKER).read_text().strip() == "3"

    from_theirs, output = train(tmp_path / "a", 1, "--load", str(theirs))
    from_ours, _ = train(tmp_path / "b", 1, "--load", str(ours), "--no-load-optim", "--no-load-rng")
    assert sorted(from_theirs) == [4, 5, 6] and sorted(from_ours) == [4, 5, 6]
    assert from_theirs == pytest.approx(from_ours, rel=1e-6)
    assert f"resumed from {theirs / 'iter_0000003'} (iteration 3)" in output
    assert "is a Megatron-LM checkpoint: its model weights are loaded, its optimizer state and RNG states not" \
        in output, output[-3000:]
