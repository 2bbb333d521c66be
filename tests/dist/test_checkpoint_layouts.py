"""A checkpoint saved under one TP x PP layout resumes under another.

Checkpoints are megatron-core torch_dist checkpoints of ``sharded_state_dict``s, whose keys are global
(a layer at its global number, a TP shard at its offset in the full matrix): each test trains a run
straight through 6 iterations, saving at 3 and 6, points the tracker back at 3 (Megatron-LM's way of
picking the iteration to resume) and resumes it under another layout; iterations 4-6 must equal the
straight run's within the equivalence tests' loss tolerance (fp32; only summation orders differ).
Same-layout resumes must be exact. Dropout is off: masks depend on the layout's RNG streams.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.checkpoints import TRACKER, assert_megatron_checkpoint, layer_writers
from tests.dist.launch import check_ok, launch
from tests.model_flags import model_flags

LOSS_RTOL = 1e-5  # as tests/dist/test_dpp_equivalence.py
ARGS = [*model_flags(layers=4), "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-iters", "8", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--transport", "gloo", "--log-interval", "1", "--train-iters", "6"]


def train(out: Path, world: int, *layout: str) -> tuple[dict[int, float], str]:
    results = launch(["tests.dist.train_harness", "--out", str(out), "--", *ARGS, *layout], world, timeout_s=420)
    check_ok(results)
    losses = json.loads((out / "losses_rank0.json").read_text())
    return {int(it): v["lm loss"] for it, v in losses.items()}, results[0].output


def straight_run_with_checkpoint_at_3(tmp_path: Path, world: int, *layout: str) -> tuple[dict[int, float], Path]:
    ckpt = tmp_path / "ckpt"
    losses, _ = train(tmp_path / "straight", world, *layout, "--save", str(ckpt), "--save-interval", "3")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert_megatron_checkpoint(ckpt, 6)
    (ckpt / TRACKER).write_text("3\n")
    assert_megatron_checkpoint(ckpt, 3)
    return losses, ckpt


def assert_continues(straight: dict[int, float], resumed: dict[int, float], output: str, exact: bool) -> None:
    assert "resuming at iteration 3" in output, output[-3000:]
    assert sorted(resumed) == [4, 5, 6]  # resumed at 3, not from scratch
    for it in (4, 5, 6):
        if exact:
            assert resumed[it] == straight[it], (it, resumed[it], straight[it])
        else:
            assert resumed[it] == pytest.approx(straight[it], rel=LOSS_RTOL), (it, resumed[it], straight[it])


@pytest.mark.timeout(900)
def test_pp4_checkpoint_resumes_at_pp2_with_virtual_stages(tmp_path: Path) -> None:
    """DPP runtime chunks at PP=4 -> PP=2 x VP=2 (chunks model0/model1, layers at global numbers)."""
    straight, ckpt = straight_run_with_checkpoint_at_3(tmp_path, 4, "--pipeline-model-parallel-size", "4",
                                                        "--use-dpp")
    resumed, output = train(tmp_path / "pp2vp2", 2, "--pipeline-model-parallel-size", "2",
                            "--num-layers-per-virtual-pipeline-stage", "1", "--use-dpp", "--load", str(ckpt))
    assert_continues(straight, resumed, output, exact=False)
    assert "RNG states not restored" in output  # another layout: Megatron-LM's rule


STAGE_LAYERS = "--pipeline-stage-layers"


@pytest.mark.timeout(1200)
def test_half_layer_split_checkpoint_resumes_under_other_splits(tmp_path: Path) -> None:
    """--pipeline-stage-layers 2.5,1.5: layer 2's attention on stage 0, its MLP on stage 1, both saved
    under the layer's global index (disjoint keys). Same split exact; whole layers at PP=2, and at PP=4
    another half split (a stage of one MLP half only), within tolerance."""
    straight, ckpt = straight_run_with_checkpoint_at_3(tmp_path, 2, "--pipeline-model-parallel-size", "2",
                                                        "--use-dpp", STAGE_LAYERS, "2.5,1.5")
    # Saved split (an ignored flag would place whole layers and resume all the same).
    assert layer_writers(ckpt / "iter_0000003", 2) == {"self_attention": {0}, "mlp": {1}}
    same, output = train(tmp_path / "same", 2, "--pipeline-model-parallel-size", "2", "--use-dpp",
                         STAGE_LAYERS, "2.5,1.5", "--load", str(ckpt))
    assert_continues(straight, same, output, exact=True)
    whole, output = train(tmp_path / "pp2", 2, "--pipeline-model-parallel-size", "2", "--use-dpp", "--load", str(ckpt))
    assert_continues(straight, whole, output, exact=False)
    other, output = train(tmp_path / "pp4", 4, "--pipeline-model-parallel-size", "4", "--use-dpp",
                          STAGE_LAYERS, "1.5,1,0.5,1", "--load", str(ckpt))
    assert_continues(straight, other, output, exact=False)
    assert "RNG states not restored" in output  # another layout: Megatron-LM's rule


@pytest.mark.timeout(1200)
def test_whole_layer_checkpoint_resumes_under_a_half_layer_split(tmp_path: Path) -> None:
    """Plain PP=2 (2 + 2 layers) -> --pipeline-stage-layers 1.5,2.5 on the static 1F1B path: layer 1's
    halves load from the one stage that saved the whole layer; and -> two chunks per stage of half
    layers under DPP."""
    straight, ckpt = straight_run_with_checkpoint_at_3(tmp_path, 2, "--pipeline-model-parallel-size", "2",
                                                        "--use-dpp")
    assert layer_writers(ckpt / "iter_0000003", 1) == {"self_attention": {0}, "mlp": {0}}
    resumed, output = train(tmp_path / "halves", 2, "--pipeline-model-parallel-size", "2", STAGE_LAYERS,
                            "1.5,2.5", "--load", str(ckpt))
    assert_continues(straight, resumed, output, exact=False)
    # Two chunks per stage, one count per virtual stage: layer 0's attention alone on stage 0's chunk 0,
    # its MLP and layer 1's attention on stage 1's chunk 0, layer 1's MLP and layer 2 on stage 0's chunk 1.
    chunked, output = train(tmp_path / "vp2-halves", 2, "--pipeline-model-parallel-size", "2",
                            "--num-virtual-stages-per-pipeline-rank", "2", "--use-dpp", STAGE_LAYERS, "0.5,1,1.5,1",
                            "--load", str(ckpt))
    assert_continues(straight, chunked, output, exact=False)


@pytest.mark.timeout(900)
def test_tp2_pp2_checkpoint_resumes_on_one_rank(tmp_path: Path) -> None:
    """TP shards are joined at load. The padded vocabulary must match (TP=2 x 64 = TP=1 x 128 rows)."""
    straight, ckpt = straight_run_with_checkpoint_at_3(
        tmp_path, 4, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-dpp",
        "--make-vocab-size-divisible-by", "64")
    resumed, output = train(tmp_path / "pp1", 1, "--load", str(ckpt))
    assert_continues(straight, resumed, output, exact=False)
    # Padded to 256 rows here: the embedding cannot take the checkpoint's 128; refused, naming both.
    refused = launch(["trainer.train", *ARGS, "--load", str(ckpt), "--make-vocab-size-divisible-by", "256"], 1,
                     timeout_s=300)[0]
    assert refused.returncode != 0 and "iteration        4/" not in refused.output
    assert (f"{ckpt / 'iter_0000003'} holds an embedding padded to 128 rows, this run pads the vocabulary to 256"
            in refused.output), refused.output[-3000:]


@pytest.mark.timeout(1200)
def test_distributed_optimizer_resumes_exactly_and_under_another_layout(tmp_path: Path) -> None:
    """--use-distributed-optimizer (before: refused; earlier, a crash at the first save after training
    ran). Saved fully reshardable: same layout exact, PP=2 x DP=2 -> PP=1 x DP=2 within tolerance."""
    dist_opt = ("--use-distributed-optimizer",)
    straight, ckpt = straight_run_with_checkpoint_at_3(tmp_path, 4, "--pipeline-model-parallel-size", "2",
                                                        "--use-dpp", *dist_opt)
    same, output = train(tmp_path / "same", 4, "--pipeline-model-parallel-size", "2", "--use-dpp", *dist_opt,
                         "--load", str(ckpt))
    assert_continues(straight, same, output, exact=True)
    other, output = train(tmp_path / "dp2", 2, *dist_opt, "--load", str(ckpt))
    assert_continues(straight, other, output, exact=False)
    refused = launch(["trainer.train", *ARGS, "--load", str(ckpt)], 1, timeout_s=300)[0]
    assert refused.returncode != 0
    assert (f"{ckpt / 'iter_0000003'} was saved with --use-distributed-optimizer: resume with it"
            in refused.output), refused.output[-3000:]


@pytest.mark.timeout(900)
def test_distributed_optimizer_resumes_a_half_layer_split_exactly(tmp_path: Path) -> None:
    """--use-distributed-optimizer over --pipeline-stage-layers 2.5,1.5: stage 0's layers end mid-bucket,
    so the shared embedding's own bucket follows a padded bucket end. Before: megatron-core 0.16 saved
    the embedding's optimizer state from 64 elements further on (trainer.megatron.compat's
    fully_reshardable_bucket_offsets), and the same-layout resume departed from the straight run."""
    layout = ("--pipeline-model-parallel-size", "2", "--use-dpp", "--use-distributed-optimizer")
    straight, ckpt = straight_run_with_checkpoint_at_3(tmp_path, 2, *layout, STAGE_LAYERS, "2.5,1.5")
    same, output = train(tmp_path / "same", 2, *layout, STAGE_LAYERS, "2.5,1.5", "--load", str(ckpt))
    assert_continues(straight, same, output, exact=True)
    whole, output = train(tmp_path / "pp2", 2, *layout, "--load", str(ckpt))
    assert_continues(straight, whole, output, exact=False)


@pytest.mark.timeout(300)
def test_unreadable_load_fails_before_training_naming_the_path(tmp_path: Path) -> None:
    """Before: a folder --load could not read was ignored ("resuming at iteration 0")."""
    old = tmp_path / "old"
    (old / "iter_0000020").mkdir(parents=True)
    (old / "iter_0000020" / "rank_00000.pt").write_bytes(b"")
    (old / "latest").write_text("20\n")
    result = launch(["trainer.train", *ARGS, "--load", str(old)], 1, timeout_s=240)[0]
    assert result.returncode != 0
    assert f"--load {old} holds a checkpoint in this trainer's old per-rank format" in result.output
    assert "iteration        1/" not in result.output and "resuming at iteration" not in result.output
