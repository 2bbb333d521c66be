"""Pipeline schedules as pure policies, and the discrete-event simulator that compares them.

``make_policy(name, shape, stage, **options)`` builds the policy one stage runs; the runtime loops
``drain arrivals -> state.mark_*_arrived; action = policy.choose(state); run it; state.mark_done``.
"""

from trainer.schedule.core import Action, Op, PipelineShape, Policy, StageState
from trainer.schedule.dynamic import DynamicOptions, one_f_one_b_cap
from trainer.schedule.registry import POLICY_NAMES, SPLIT_BACKWARD, make_policy, supports_chunks

__all__ = [
    "Action", "DynamicOptions", "Op", "POLICY_NAMES", "PipelineShape", "Policy", "SPLIT_BACKWARD",
    "StageState", "make_policy", "one_f_one_b_cap", "supports_chunks",
]
