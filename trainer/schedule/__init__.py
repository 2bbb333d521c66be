"""Pipeline schedules as pure policies, and the discrete-event simulator that compares them."""

from trainer.schedule.core import Action, Op, PipelineShape, Policy, StageState

__all__ = ["Action", "Op", "PipelineShape", "Policy", "StageState"]
