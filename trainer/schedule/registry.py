"""``make_policy(name, shape, stage, **options)``: the one way the runtime and simulator build policies.

Names: ``gpipe``, ``1f1b``, ``interleaved`` (Megatron-Core's interleaved 1F1B, ``v >= 2``),
``zb-h1`` (split backward), ``dpp`` (greedy), ``dpp-zb`` (greedy, split backward, W fills idle
time). Options are validated: an option a policy does not take is an error, never ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.schedule.core import PipelineShape, Policy
from trainer.schedule.dynamic import DynamicOptions, DynamicPolicy
from trainer.schedule.static import (
    StaticPolicy,
    gpipe_order,
    interleaved_order,
    one_f_one_b_order,
    zb_h1_order,
)

STATIC_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
DYNAMIC_SCHEDULES = ("dpp", "dpp-zb")
POLICY_NAMES = STATIC_SCHEDULES + DYNAMIC_SCHEDULES
SPLIT_BACKWARD = frozenset({"zb-h1", "dpp-zb"})
"""Schedules whose backwards run as I then W (the simulator and runtime need to know)."""


def supports_chunks(name: str, num_chunks: int) -> bool:
    """Whether schedule ``name`` can run with ``num_chunks`` model chunks per stage."""
    if name in ("1f1b", "zb-h1"):
        return num_chunks == 1
    if name == "interleaved":
        return num_chunks >= 2
    return True


def _reject_options(name: str, options: dict[str, Any], allowed: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"schedule {name!r} takes no option(s) {unknown} (accepted: {accepted})")


def _static(name: str, builder: Callable[..., list], split: bool = False):
    def build(shape: PipelineShape, stage: int, options: dict[str, Any]) -> Policy:
        allowed = ("group_size", "microbatch_order") if name == "interleaved" else ("microbatch_order",)
        _reject_options(name, options, allowed)
        order = options.pop("microbatch_order", "index")
        return StaticPolicy(name, builder(shape, stage, **options), split_backward=split,
                            microbatch_order=order)

    return build


def _dynamic(name: str, split: bool):
    def build(shape: PipelineShape, stage: int, options: dict[str, Any]) -> Policy:
        _reject_options(name, options, tuple(DynamicOptions.__dataclass_fields__))
        return DynamicPolicy(name, shape, stage, DynamicOptions(**options), split_backward=split)

    return build


_BUILDERS = {
    "gpipe": _static("gpipe", gpipe_order),
    "1f1b": _static("1f1b", one_f_one_b_order),
    "interleaved": _static("interleaved", interleaved_order),
    "zb-h1": _static("zb-h1", zb_h1_order, split=True),
    "dpp": _dynamic("dpp", split=False),
    "dpp-zb": _dynamic("dpp-zb", split=True),
}


def make_policy(name: str, shape: PipelineShape, stage: int, **options: Any) -> Policy:
    """The policy ``name`` for ``stage`` of ``shape``.

    Dynamic options: ``max_inflight`` (int cap on held activations, chunk units), ``cap_factor``
    (x 1F1B's bound, default 1.0), ``priority`` ("forward" | "backward"), ``chunk_order``
    ("depth" | "breadth"), ``microbatch_order`` ("cost": by ``StageState.microbatch_costs`` when
    given | "index"), ``weight_order`` (dpp-zb: "oldest" | "youngest"; default youngest at v = 1, oldest
    above). Static schedules take
    ``microbatch_order`` too (default "index": Megatron's). ``interleaved`` takes ``group_size`` (Megatron's
    ``microbatch_group_size_per_vp_stage``). Raises ValueError naming any bad name, option or size.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(POLICY_NAMES)}")
    if not 0 <= stage < shape.num_stages:
        raise ValueError(f"stage={stage} outside [0, num_stages={shape.num_stages})")
    if not supports_chunks(name, shape.num_chunks):
        need = "num_chunks >= 2" if name == "interleaved" else "num_chunks == 1"
        raise ValueError(f"schedule {name!r} needs {need}, got num_chunks={shape.num_chunks}")
    return _BUILDERS[name](shape, stage, options)
