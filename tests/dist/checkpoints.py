"""What a checkpoint folder written by trainer.train must look like: Megatron-LM's layout
(``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/``) holding a megatron-core torch_dist checkpoint."""

from __future__ import annotations

import json
import re
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


def layer_writers(folder: Path, layer: int) -> dict[str, set[int]]:
    """``{"self_attention": ranks, "mlp": ranks}``: which ranks wrote layer ``layer``'s model tensors into
    ``folder`` (torch_dist names each rank's files ``__<rank>_<thread>.distcp``; layer tensors are keyed
    ``decoder.layers.<module>...`` at the layer's global index along their first dimension)."""
    from torch.distributed.checkpoint import FileSystemReader

    writers: dict[str, set[int]] = {}
    for index, info in FileSystemReader(str(folder)).read_metadata().storage_data.items():
        module = re.match(r"decoder\.layers\.(self_attention|mlp)\.[^/]*$", index.fqn)
        if module and index.offset is not None and index.offset[0] == layer:
            rank = int(re.match(r"__(\d+)_", info.relative_path).group(1))
            writers.setdefault(module.group(1), set()).add(rank)
    return writers
