"""Finding the checkpoint to resume: Megatron-LM's tracker and folder layout, read from files alone.

Nothing here needs torch or a process group (megatron-core is imported only to read a checkpoint's
metadata), so a bad ``--load`` fails in seconds; trainer/checkpoint/state.py saves checkpoints and
loads the one :func:`find_checkpoint` names.

``--load DIR``: a missing or empty ``DIR`` starts fresh; anything else must be a tracker naming a
complete torch_dist checkpoint written by this trainer or by Megatron-LM, and whatever :func:`find_checkpoint` cannot
read (a tracker naming a missing folder, Megatron-LM's legacy ``mp_rank_*`` format, this trainer's old
per-rank format, a folder without tracker) raises :class:`CheckpointError` naming the path, before
any process group starts (:func:`preflight`, which trainer/train.py calls first thing).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path
from typing import Any

from trainer.checkpoint.watchdog import TimeoutSettingError, checkpoint_timeout_s

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name (get_checkpoint_tracker_filename)
FORMAT = "mdpp-torch_dist-1"  # this trainer's content version, in common.pt's 'mdpp' section
_ITER_DIR = re.compile(r"^iter_\d{7}$")
# Megatron-LM's legacy 'torch' format: iter_N/mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt
_LEGACY_RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")


class CheckpointError(RuntimeError):
    """``--load`` names something this trainer cannot resume from (the message names the path)."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _is_leftover(name: str) -> bool:
    """What a crashed save leaves (never complete, never read): iter_N.tmp/ and the tracker's tmp file."""
    return name.endswith(".tmp") or name.startswith(TRACKER + ".tmp")


def remove_leftovers(root: Path) -> None:
    """Rank 0, before a save: remove what unfinished saves left in ``root``, whatever their iteration.
    A save killed by SIGKILL (Slurm's, KillWait after its TERM, while the ranks saved on that TERM)
    leaves ``iter_N.tmp/`` for an iteration the resumed run may never save again."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if _is_leftover(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def preflight(load: str | None, save: str | None) -> None:
    """What can fail before any process group starts (and before training ran): an unreadable
    ``--load`` (:func:`find_checkpoint`), and a ``--save`` that megatron-core's writer cannot do."""
    find_checkpoint(load)
    if load or save:
        try:
            checkpoint_timeout_s()  # a bad $MDPP_CHECKPOINT_TIMEOUT_S fails now, not at the first save
        except TimeoutSettingError as err:
            raise CheckpointError(str(err)) from None
    if save and importlib.util.find_spec("psutil") is None:
        # megatron-core's torch_dist writer forks worker processes that call psutil first thing; one
        # that fails there never reports, and the parent then waits for it forever.
        raise CheckpointError(f"--save {save} needs psutil (megatron-core's checkpoint writer uses it): "
                              "pip install psutil")


# ---- finding the checkpoint (no torch.distributed: runs before any process group) ---------------
def find_checkpoint(root: str | None) -> tuple[int, Path] | None:
    """(iteration, folder) that ``root``'s tracker names; None for a missing or empty ``root``.

    Raises :class:`CheckpointError`, naming the path, for everything else it cannot resume from.
    Reads only files, so it can run before the process group (every rank sees the same folder).
    """
    if not root:
        return None
    folder = Path(root)
    if not folder.exists():
        return None
    if not folder.is_dir():
        raise CheckpointError(f"--load {folder}: not a directory")
    tracker = folder / TRACKER
    if not tracker.is_file():
        _refuse_without_tracker(folder)
        return None
    try:
        text = tracker.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{tracker}: cannot be read as Megatron-LM's tracker (an iteration number): "
                              f"{err}") from None
    if text == "release":
        raise CheckpointError(f"{tracker} says 'release': a Megatron-LM release (weights-only) checkpoint, which "
                              "this trainer does not resume from (it needs the optimizer, scheduler and counters "
                              "of a training checkpoint)")
    if not (text.isascii() and text.isdigit()):  # str.isdigit alone accepts '³', which int() refuses
        raise CheckpointError(f"{tracker}: expected an iteration number (or 'release'), found {text!r}")
    iteration = int(text)
    path = iteration_dir(folder, iteration)
    if not path.is_dir():
        raise CheckpointError(f"{tracker} names iteration {iteration} but {path} is missing")
    _check_is_torch_dist(path)
    read_common_state(path)  # refuses a torch_dist checkpoint some other program wrote
    return iteration, path


def _refuse_without_tracker(folder: Path) -> None:
    entries = sorted(p.name for p in folder.iterdir() if not _is_leftover(p.name))
    if not entries:
        return  # empty (or only a crashed first save's leftovers): start fresh
    if (folder / "latest").is_file():
        raise CheckpointError(
            f"--load {folder} holds a checkpoint in this trainer's old per-rank format ('latest' + "
            "iter_*/rank_*.pt), which it no longer reads (checkpoints are megatron-core torch_dist now): "
            "start a new run in a new folder, or finish this one with the version that wrote it")
    if (folder / "metadata.json").is_file():
        raise CheckpointError(
            f"--load {folder} is one checkpoint iteration, not a checkpoint folder: pass the folder that "
            f"holds it and {TRACKER} (its parent, {folder.parent}, as Megatron-LM's --load expects)")
    iters = [e for e in entries if _ITER_DIR.match(e)]
    if iters:
        raise CheckpointError(
            f"--load {folder} holds {', '.join(iters[:3])}{' ...' if len(iters) > 3 else ''} but no {TRACKER}: "
            f"write the iteration to resume into {folder / TRACKER}, or load from an empty folder to start fresh")
    shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
    raise CheckpointError(f"--load {folder} is not empty ({shown}) but holds no {TRACKER}: not a checkpoint "
                          "folder this trainer can read (an empty or missing folder starts fresh)")


def _check_is_torch_dist(path: Path) -> None:
    from megatron.core.dist_checkpointing.core import maybe_load_config

    try:
        config = maybe_load_config(str(path))
    except Exception as err:  # an unreadable or foreign metadata.json
        raise CheckpointError(f"{path / 'metadata.json'} cannot be read as a megatron-core checkpoint "
                              f"config: {err}") from err
    if config is None:
        legacy = sorted(p.name for p in path.iterdir() if _LEGACY_RANK_DIR.match(p.name))
        if legacy:
            raise CheckpointError(
                f"{path} is a Megatron-LM checkpoint in the legacy 'torch' format ({legacy[0]}/model_optim_rng.pt): "
                "this trainer reads --ckpt-format torch_dist checkpoints only. Convert it with Megatron-LM (its "
                "training script with the model and parallel flags it was saved with, which loads it and saves it "
                "again, then exits): " + legacy_conversion_command(path.parent) + f"; then pass --load "
                f"{path.parent}-torch_dist/torch_dist here")
        raise CheckpointError(f"{path} is not a megatron-core distributed checkpoint (no metadata.json)")
    if config.sharded_backend != "torch_dist":
        raise CheckpointError(f"{path} was saved with the {config.sharded_backend!r} backend; this trainer reads "
                              "'torch_dist' checkpoints only")


def legacy_conversion_command(root: Path) -> str:
    """Megatron-LM's conversion of the legacy 'torch' checkpoint folder ``root`` to torch_dist
    (megatron/training/training.py: with --ckpt-convert-format it saves into <--ckpt-convert-save>/<format>
    right after loading, then exits)."""
    return (f"torchrun ... pretrain_gpt.py <the run's flags> --load {root} --ckpt-format torch "
            f"--ckpt-convert-format torch_dist --ckpt-convert-save {root}-torch_dist")


MEGATRON_LM_FORMAT = "megatron-lm"
"""The 'format' given to a torch_dist checkpoint Megatron-LM (or megatron-core's own save path) wrote."""


def _megatron_lm_facts(path: Path, common: dict[str, Any]) -> dict[str, Any]:
    """What _load needs from a Megatron-LM checkpoint's common state ('args', 'iteration',
    'checkpoint_version'), in the form of this trainer's 'mdpp' section: the model's shape from its
    args (compared with this run's), the consumed samples, the layout and the padded vocabulary."""
    args = common["args"]
    if not hasattr(args, "num_layers"):
        raise CheckpointError(f"{path}: a Megatron-LM checkpoint whose 'args' ({type(args).__name__}) do not name "
                              "the model (num_layers, hidden_size, ...): cannot check it matches this run")
    ffn = getattr(args, "ffn_hidden_size", None)
    identity = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                "num_attention_heads": args.num_attention_heads,
                "seq_length": getattr(args, "seq_length", None)}
    if ffn is not None:
        identity["ffn_hidden_size"] = ffn
    return {"format": MEGATRON_LM_FORMAT,
            "megatron_lm": _megatron_lm_contents(common),
            "consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "layout": {"world_size": getattr(args, "world_size", None),
                       "tp": getattr(args, "tensor_model_parallel_size", 1),
                       "pp": getattr(args, "pipeline_model_parallel_size", 1),
                       "vp": getattr(args, "virtual_pipeline_model_parallel_size", None) or 1},
            "padded_vocab_size": getattr(args, "padded_vocab_size", None),
            "identity": {k: v for k, v in identity.items() if v is not None},
            "use_distributed_optimizer": bool(getattr(args, "use_distributed_optimizer", False))}


MEGATRON_LM_RESHARDABLE = frozenset({"fully_reshardable", "fully_sharded_model_space"})
"""The distributed optimizer's sharding types that load under another TP/PP layout (megatron-core's
DistributedOptimizer.checkpoint_fully_reshardable_formats); the others are keyed by its TP x PP groups."""


def _megatron_lm_contents(common: dict[str, Any]) -> dict[str, Any]:
    """What a Megatron-LM checkpoint holds besides the weights, from its common state.

    Megatron-LM's generate_state_dict writes 'optimizer' (sharded) and 'opt_param_scheduler' unless
    --no-save-optim, 'rng_state' unless --no-save-rng; the sharding switches its optimizer state was
    saved with are its 'content_metadata' (megatron-core's save(content_metadata=...)), which older
    releases did not write: there they follow from its args as its loader derives them."""
    args = common["args"]
    metadata = common.get("content_metadata")
    distributed = bool(getattr(args, "use_distributed_optimizer", False))
    if not isinstance(metadata, dict):
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if distributed:
            metadata["distrib_optim_sharding_type"] = (
                "fully_sharded_model_space" if getattr(args, "ckpt_fully_parallel_save", False)
                else "dp_zero_gather_scatter")
    precision = "fp16" if getattr(args, "fp16", False) else "bf16" if getattr(args, "bf16", False) else "fp32"
    return {"has_optimizer": not getattr(args, "no_save_optim", False) and "opt_param_scheduler" in common,
            "has_rng": not getattr(args, "no_save_rng", False),
            "optimizer": getattr(args, "optimizer", "adam"), "precision": precision,
            "use_distributed_optimizer": distributed,
            "sharding": {k: v for k, v in metadata.items() if isinstance(v, str | bool | int | float)}}


def read_common_state(path: Path) -> dict[str, Any]:
    """common.pt: this trainer's, or Megatron-LM's (its 'args', 'iteration' and 'checkpoint_version',
    turned into an 'mdpp' section of format MEGATRON_LM_FORMAT); any other torch_dist checkpoint is
    named and refused."""
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception as err:
        raise CheckpointError(f"{path}: its common state (common.pt) cannot be read: {err}") from err
    ours = common.get("mdpp") if isinstance(common, dict) else None
    if ours is None and isinstance(common, dict) and {"args", "iteration", "checkpoint_version"} <= set(common):
        return {**common, "mdpp": _megatron_lm_facts(path, common)}
    if not isinstance(ours, dict) or ours.get("format") != FORMAT:
        found = ours.get("format") if isinstance(ours, dict) else "no 'mdpp' section"
        raise CheckpointError(f"{path} is a torch_dist checkpoint but not one this trainer wrote (format {FORMAT!r} "
                              f"expected, found {found!r}; a Megatron-LM checkpoint is read when its common.pt holds Megatron-LM's "
                              "'args', 'iteration' and 'checkpoint_version')")
    return common
