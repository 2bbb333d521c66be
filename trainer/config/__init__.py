"""The training configuration: parsed once, checked once, then resolved into the run plan.

- :mod:`~trainer.config.sections` and :mod:`~trainer.config.training`: the typed frozen sections
  (Megatron-LM's flag names; each checks its own fields);
- :mod:`~trainer.config.layout`: checks that need the world size or several sections;
- :mod:`~trainer.config.plan`: which schedule runs and why, the layer split, the link options
  (:func:`resolve_plan` -> :class:`RunPlan`), and the schedule's refusals;
- :mod:`~trainer.config.transformer_engine`: Transformer Engine's layer spec and attention backends;
- :mod:`~trainer.config.parser`: the one command-line parser and :func:`parse_config`.
"""

from trainer.config.layout import layout_problems
from trainer.config.llama import llama_identity, llama_layout_problems
from trainer.config.optim import DECAY_STYLES, DEFAULT_TRAIN_ITERS, OptimConfig
from trainer.config.parser import build_parser, field_docs, parse_config, unsupported_flag_problems
from trainer.config.plan import (
    LayerPlan,
    LinkPlan,
    PolicyOptions,
    RngPlan,
    RunPlan,
    SchedulePlan,
    resolve_dpp_policy,
    resolve_plan,
    split_backward_refusals,
)
from trainer.config.sections import (
    ATTENTION_BACKENDS,
    DPP_POLICIES,
    ConfigError,
    ModelConfig,
    ParallelConfig,
)
from trainer.config.training import CheckpointConfig, DataConfig, RunConfig, TrainConfig
from trainer.config.transformer_engine import (
    NVTE_ATTENTION_ENV,
    NVTE_ATTENTION_VALUES,
    TE_ATTENTION_BACKENDS,
    attention_backend_problems,
    uses_transformer_engine_spec,
)

__all__ = [
    "llama_identity", "llama_layout_problems",
    "ATTENTION_BACKENDS", "CheckpointConfig", "ConfigError", "DECAY_STYLES", "DEFAULT_TRAIN_ITERS", "DPP_POLICIES",
    "DataConfig", "LayerPlan", "LinkPlan", "ModelConfig", "NVTE_ATTENTION_ENV", "NVTE_ATTENTION_VALUES",
    "OptimConfig", "ParallelConfig", "PolicyOptions", "RngPlan", "RunConfig", "RunPlan", "SchedulePlan", "TE_ATTENTION_BACKENDS",
    "TrainConfig", "attention_backend_problems", "build_parser", "field_docs", "layout_problems", "parse_config",
    "resolve_dpp_policy", "resolve_plan", "split_backward_refusals", "unsupported_flag_problems",
    "uses_transformer_engine_spec",
]
