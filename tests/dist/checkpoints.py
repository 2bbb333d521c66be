"""What a checkpoint folder written by trainer.train must look like: Megatron-LM's layout
(``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/``) holding a megatron-core torch_dist checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.checkpoint.find import FORMAT, read_common_state

TRACKER = "latest_checkpointed_iteration.txt"


def assert_megatron_checkpoint(root: Path, iteration: int) -> Path:
    """``root``'s tracker names ``iteration`` and ``iter_<iteration>`` is a complete torch_dist checkpoint."""
    assert (root / TRACKER).read_text().strip() == str(iteration)
    folder = root / f"iter_{iteration:07d}"
    names = {p.name for p in folder.iterdir()}
    # megatron-core 0.16 writes rank 0's common state to common.pt; 0.19 keeps it inside the .distcp
    # files: require what both write, then read the common state back the way a resume does.
    assert {"metadata.json", ".metadata"} <= names, sorted(names)
    assert any(name.endswith(".distcp") for name in names), sorted(names)
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert not list(root.glob("*.tmp")), "a save left its temporary folder behind"
    assert read_common_state(folder)["mdpp"]["format"] == FORMAT
    return folder
