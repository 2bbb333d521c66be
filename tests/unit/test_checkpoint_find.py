"""``--load`` of a folder the trainer cannot resume from fails, naming the path.

Before: a Megatron checkpoint given to --load was silently ignored ("resuming at iteration 0").
find_checkpoint reads files only (it runs before any process group); the folders here are built by
hand in the layouts named, with common.pt / metadata.json written the way megatron-core writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.checkpoint.find import FORMAT, TRACKER, CheckpointError, find_checkpoint, preflight

TORCH_DIST = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
              "common_backend": "torch", "common_backend_version": 1}


def torch_dist_folder(root: Path, iteration: int, common: dict, tracker: str | None = None) -> Path:
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps(TORCH_DIST))
    torch.save(common, folder / "common.pt")
    (root / TRACKER).write_text(f"{iteration if tracker is None else tracker}\n")
    return folder


def test_missing_or_empty_folder_starts_fresh(tmp_path: Path) -> None:
    assert find_checkpoint(None) is None
    assert find_checkpoint(str(tmp_path / "nothing-here")) is None
    assert find_checkpoint(str(tmp_path)) is None
    (tmp_path / "iter_0000005.tmp").mkdir()  # a first save that crashed: nothing complete yet
    (tmp_path / f"{TRACKER}.tmp123").write_text("5")
    assert find_checkpoint(str(tmp_path)) is None


def test_own_checkpoint_is_found_at_the_tracker_iteration(tmp_path: Path) -> None:
    torch_dist_folder(tmp_path, 3, {"iteration": 3, "mdpp": {"format": FORMAT}})
    torch_dist_folder(tmp_path, 6, {"iteration": 6, "mdpp": {"format": FORMAT}}, tracker="3")
    assert find_checkpoint(str(tmp_path)) == (3, tmp_path / "iter_0000003")


def refused(root: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        find_checkpoint(str(root))
    return str(err.value)


def test_tracker_naming_a_missing_folder(tmp_path: Path) -> None:
    (tmp_path / TRACKER).write_text("100\n")
    assert f"{tmp_path / TRACKER} names iteration 100 but {tmp_path / 'iter_0000100'} is missing" in refused(tmp_path)


def test_tracker_that_is_no_iteration(tmp_path: Path) -> None:
    (tmp_path / TRACKER).write_text("best\n")
    assert f"{tmp_path / TRACKER}: expected an iteration number (or 'release'), found 'best'" in refused(tmp_path)
    (tmp_path / TRACKER).write_text("release\n")
    assert "Megatron-LM release (weights-only) checkpoint" in refused(tmp_path)
    (tmp_path / TRACKER).write_text("\u00b3\n")  # a digit to str.isdigit, not to int()
    assert f"{tmp_path / TRACKER}: expected an iteration number (or 'release'), found '\u00b3'" in refused(tmp_path)
    (tmp_path / TRACKER).write_bytes(b"\xff\xfe1\n")
    assert f"{tmp_path / TRACKER}: cannot be read as Megatron-LM's tracker" in refused(tmp_path)


def test_megatron_legacy_torch_format(tmp_path: Path) -> None:
    rank_dir = tmp_path / "iter_0000010" / "mp_rank_00_000"
    rank_dir.mkdir(parents=True)
    (rank_dir / "model_optim_rng.pt").write_bytes(b"")
    (tmp_path / TRACKER).write_text("10")
    message = refused(tmp_path)
    assert f"{tmp_path / 'iter_0000010'} is a Megatron-LM checkpoint in the legacy 'torch' format" in message
    # Megatron-LM's own conversion (training.py: load, save under <--ckpt-convert-save>/torch_dist, exit),
    # with this folder filled in, and where to point --load afterwards.
    assert (f"--load {tmp_path} --ckpt-format torch --ckpt-convert-format torch_dist "
            f"--ckpt-convert-save {tmp_path}-torch_dist") in message
    assert f"then pass --load {tmp_path}-torch_dist/torch_dist here" in message


def test_iteration_folder_that_is_no_distributed_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "iter_0000010").mkdir()
    (tmp_path / TRACKER).write_text("10")
    assert f"{tmp_path / 'iter_0000010'} is not a megatron-core distributed checkpoint" in refused(tmp_path)


def test_other_backend(tmp_path: Path) -> None:
    folder = torch_dist_folder(tmp_path, 10, {"mdpp": {"format": FORMAT}})
    (folder / "metadata.json").write_text(json.dumps({**TORCH_DIST, "sharded_backend": "zarr"}))
    assert f"{folder} was saved with the 'zarr' backend" in refused(tmp_path)


def test_torch_dist_checkpoint_of_another_program(tmp_path: Path) -> None:
    """A torch_dist common.pt with iteration and checkpoint_version but neither Megatron-LM's 'args' (which
    name the model, so a Megatron-LM checkpoint loads: tests/dist/test_megatron_lm_checkpoint.py) nor ours."""
    folder = torch_dist_folder(tmp_path, 10, {"iteration": 10, "checkpoint_version": 3.0})
    message = refused(tmp_path)
    assert f"{folder} is a torch_dist checkpoint but not one this trainer wrote" in message
    folder_b = torch_dist_folder(tmp_path / "b", 10, {"mdpp": {"format": "mdpp-torch_dist-0"}})
    assert "found 'mdpp-torch_dist-0'" in refused(tmp_path / "b") and str(folder_b) in refused(tmp_path / "b")


def test_old_per_rank_format(tmp_path: Path) -> None:
    (tmp_path / "iter_0000020").mkdir()
    (tmp_path / "iter_0000020" / "rank_00000.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("20\n")
    assert f"--load {tmp_path} holds a checkpoint in this trainer's old per-rank format" in refused(tmp_path)


def test_one_iteration_folder_given_instead_of_its_parent(tmp_path: Path) -> None:
    folder = torch_dist_folder(tmp_path, 4, {"mdpp": {"format": FORMAT}})
    assert f"--load {folder} is one checkpoint iteration, not a checkpoint folder" in refused(folder)


def test_iteration_folders_without_tracker(tmp_path: Path) -> None:
    torch_dist_folder(tmp_path, 4, {"mdpp": {"format": FORMAT}})
    (tmp_path / TRACKER).unlink()
    assert f"--load {tmp_path} holds iter_0000004 but no {TRACKER}" in refused(tmp_path)


def test_unrelated_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    assert f"--load {tmp_path} is not empty (notes.txt) but holds no {TRACKER}" in refused(tmp_path)
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        find_checkpoint(str(tmp_path / "file"))


def test_preflight_checks_load(tmp_path: Path) -> None:
    (tmp_path / TRACKER).write_text("7")
    with pytest.raises(CheckpointError, match="names iteration 7"):
        preflight(str(tmp_path), None)
    preflight(None, str(tmp_path / "save"))  # psutil is installed here: nothing to refuse
