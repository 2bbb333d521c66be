"""What of a Megatron-LM checkpoint a run loads besides the weights, by Megatron-LM's rules: its
optimizer and LR scheduler state where this run builds the same optimizer, its RNG states under the
same TP x PP (trainer/checkpoint/state.py loads them; trainer/checkpoint/find.py reads the checkpoint's
contents into the 'mdpp' facts both take)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.checkpoint.facts import RunFacts
from trainer.checkpoint.find import CheckpointError

log = logging.getLogger(__name__)


def megatron_lm_optimizer_differences(saved: dict[str, Any], facts: RunFacts) -> list[str]:
    """'what: checkpoint X, this run Y' for everything that keeps this run from loading the optimizer
    state of a Megatron-LM checkpoint (``saved``: its 'mdpp' facts, trainer/checkpoint/find.py).

    The state is megatron-core's own sharded optimizer state, so it loads where this run builds the same
    optimizer: the same algorithm (its moments), the same precision wrapper (fp16/bf16 keep fp32 main
    weights and, with fp16, a loss scaler) and the same distributed-optimizer choice. A plain optimizer's
    state is sharded like the parameters and reshards with them; a distributed optimizer's does only in
    the fully reshardable forms, the others are keyed by the TP x PP groups it was saved under."""
    contents, layout = saved["megatron_lm"], saved["layout"]
    p = [f"--optimizer: checkpoint {contents['optimizer']!r}, this run {facts.identity.get('optimizer')!r}"
         ] if contents["optimizer"] != facts.identity.get("optimizer") else []
    if contents["precision"] != facts.precision:
        p.append(f"precision (--fp16/--bf16): checkpoint {contents['precision']}, this run {facts.precision}")
    if contents["use_distributed_optimizer"] != facts.use_distributed_optimizer:
        p.append(f"--use-distributed-optimizer: checkpoint {contents['use_distributed_optimizer']}, "
                 f"this run {facts.use_distributed_optimizer}")
    elif facts.use_distributed_optimizer:
        from trainer.checkpoint.find import MEGATRON_LM_RESHARDABLE

        sharding = contents["sharding"].get("distrib_optim_sharding_type")
        if sharding not in MEGATRON_LM_RESHARDABLE:
            p.extend(f"{flag}: checkpoint {layout[key]}, this run {facts.layout[key]} (the distributed optimizer's "
                     f"{sharding!r} state loads under its own TP x PP layout only; Megatron-LM saves the reshardable "
                     "form with --dist-ckpt-optim-fully-reshardable)"
                     for key, flag in (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
                                       ("vp", "virtual pipeline stages")) if layout[key] != facts.layout[key])
    return p


def megatron_lm_loads(path: Path, saved: dict[str, Any], facts: RunFacts, options) -> tuple[bool, bool]:
    """(optimizer and LR scheduler, RNG states): what of a Megatron-LM checkpoint is loaded besides the
    weights, by Megatron-LM's rules: what it holds (not what --no-save-optim / --no-save-rng left out)
    unless --no-load-optim / --no-load-rng / --finetune; RNG states only under the same (TP, PP) as
    saved. An optimizer state this run cannot take is refused (CheckpointError naming what differs)."""
    contents, layout = saved["megatron_lm"], saved["layout"]
    wants_optimizer = options is None or options.loads_optimizer
    wants_rng = options is None or options.loads_rng
    loads_optimizer = wants_optimizer and contents["has_optimizer"]
    if loads_optimizer:
        differences = megatron_lm_optimizer_differences(saved, facts)
        if differences:
            raise CheckpointError(f"{path}: this Megatron-LM checkpoint's optimizer state does not fit this run's "
                                  f"optimizer ({'; '.join(differences)}): resume with the checkpoint's settings, "
                                  "or start the optimizer afresh with --no-load-optim (or --finetune)")
    same_tp_pp = (layout["tp"], layout["pp"]) == (facts.layout["tp"], facts.layout["pp"])
    loads_rng = wants_rng and contents["has_rng"] and same_tp_pp
    not_loaded = []
    if wants_optimizer and not loads_optimizer:
        not_loaded.append("optimizer and LR scheduler state (saved with --no-save-optim)")
    if wants_rng and not loads_rng:
        not_loaded.append("RNG states (" + ("saved with --no-save-rng" if not contents["has_rng"] else
                                            f"saved under TP={layout['tp']} PP={layout['pp']}, this run has "
                                            f"TP={facts.layout['tp']} PP={facts.layout['pp']}, as Megatron-LM's rule") + ")")
    if dist.get_rank() == 0:
        loaded = ["model weights"] + (["optimizer and LR scheduler state"] if loads_optimizer else []) + \
            (["RNG states"] if loads_rng else [])
        log.info("%s is a Megatron-LM checkpoint: loading its %s%s", path, ", ".join(loaded),
                 f"; not its {' and '.join(not_loaded)}" if not_loaded else "")
    return loads_optimizer, loads_rng
