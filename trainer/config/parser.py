"""The one command-line parser: flags named like Megatron-LM's, defaults, help text and choices read from
the sections' dataclasses (a field's docstring is its help, a ``Literal`` type hint its choices), and
:func:`parse_config`, which runs every check and raises one :class:`ConfigError` listing every problem.

Choices are shown in ``--help`` but not enforced by argparse: a bad value reaches the section's own
check, whose message joins every other problem instead of argparse's early exit.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from collections.abc import Sequence

from trainer.cli import OneLineParser
from trainer.config.layout import layout_problems
from trainer.config.optim import OptimConfig
from trainer.config.sections import ConfigError, ModelConfig, ParallelConfig, _check
from trainer.config.training import CheckpointConfig, DataConfig, RunConfig, TrainConfig
from trainer.megatron.flags import MEGATRON_LM_FLAGS
from trainer.schedule.stage_parts import parse_stage_layers

SECTIONS = (ModelConfig, ParallelConfig, OptimConfig, DataConfig, CheckpointConfig, RunConfig)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_docs(section: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (shown by --help), read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(section)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def build_parser() -> argparse.ArgumentParser:
    """Flags named like Megatron-LM's (plus the DPP ones); defaults come from the dataclasses."""
    parser = OneLineParser(
        prog="python -m trainer.train",
        description="Train megatron-core GPT/BERT under DP x TP x PP (x VP), optionally with --use-dpp.",
        # No prefix matching: "--lr-warmup 3" silently became --lr-warmup-iters, and a Megatron-LM flag
        # that happens to prefix one of ours would be taken for it instead of being rejected.
        allow_abbrev=False,
    )
    renames = {"dpp_timeout_s": "--dpp-timeout", "overlap_p2p_comm": "--no-overlap-p2p-communication"}
    # Megatron-LM spells these two with an underscore (and, in newer releases, also with a hyphen).
    aliases = {"override_opt_param_scheduler": ("--override-opt_param-scheduler",),
               "use_checkpoint_opt_param_scheduler": ("--use-checkpoint-opt_param-scheduler",)}
    for section in SECTIONS:
        group = parser.add_argument_group(section.__name__, (section.__doc__ or "").strip())
        docs = field_docs(section)
        for f in dataclasses.fields(section):
            flag = renames.get(f.name, _flag(f.name))
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            helptext = docs.get(f.name, "").replace("%", "%%")
            kwargs: dict = {"dest": f"{section.__name__}.{f.name}", "default": default, "help": helptext}
            if f.type in ("bool",) and default is True:  # Megatron-LM's --no-<name> for default-on switches
                group.add_argument(renames.get(f.name, "--no-" + flag[2:]), action="store_false", **kwargs)
            elif f.type in ("bool",):
                group.add_argument(flag, *aliases.get(f.name, ()), action="store_true", **kwargs)
            elif f.name == "data_path":  # Megatron-LM's nargs='*': a prefix or WEIGHT PREFIX pairs
                group.add_argument(flag, nargs="+", type=str, metavar="[WEIGHT] PREFIX", **kwargs)
            elif f.name == "rampup_batch_size":  # Megatron-LM's three values
                group.add_argument(flag, nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"), **kwargs)
            elif f.name == "dpp_recompute_slots":
                group.add_argument(flag, type=_int_list, metavar="N[,N...]", **kwargs)
            elif f.name == "pipeline_stage_layers":
                group.add_argument(flag, type=_stage_layers, metavar="N[,N...]", **kwargs)
            elif f.name == "node_ips":
                group.add_argument(flag, type=lambda s: tuple(x for x in s.split(",") if x), metavar="IP,IP,...",
                                   **kwargs)
            else:
                choices = field_choices(section, f.name)
                metavar = "{" + ",".join(choices) + "}" if choices else f.name.upper()
                group.add_argument(flag, type=_parse_type(f.type), metavar=metavar, **kwargs)
    return parser


@functools.cache
def _type_hints(section: type) -> dict[str, object]:
    return typing.get_type_hints(section)


def field_choices(section: type, name: str) -> tuple[str, ...]:
    """The values a field's ``Literal`` type hint allows (None left out), or () for other types."""
    hint = _type_hints(section)[name]
    for arg in (hint, *typing.get_args(hint)):  # Literal[...] or Literal[...] | None
        if typing.get_origin(arg) is typing.Literal:
            return tuple(_literal_values(arg))
    return ()


def _literal_values(hint: object) -> list[str]:
    out: list[str] = []
    for value in typing.get_args(hint):  # a Literal may nest Literals (names.TokenizerType)
        out.extend(_literal_values(value) if typing.get_origin(value) is typing.Literal else [str(value)])
    return out


def _int_list(text: str) -> tuple[int, ...]:
    """``1,0,2`` -> (1, 0, 2); argparse turns the ValueError into an error naming the value."""
    return tuple(int(x) for x in text.split(","))


_int_list.__name__ = "comma-separated integer list"  # argparse names the type in its error


def _stage_layers(text: str) -> tuple[float, ...]:
    """``4.5,4,4,3.5`` -> (4.5, 4, 4, 3.5): trainer.schedule.stage_parts's reading. Its error names
    the entry that is not a number; argparse prints an ArgumentTypeError's text (a ValueError's it
    replaces with the whole value)."""
    try:
        return parse_stage_layers(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _looks_like_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def unsupported_flag_problems(extras: Sequence[str]) -> list[str]:
    """What argparse left unparsed, as at most three problems: the Megatron-LM flags this trainer does
    not implement (one message naming all of them), unknown flags, and stray values.

    Nothing is ever accepted and ignored: a Megatron-LM command line either runs with every flag
    meaning what it means in Megatron-LM, or is refused before anything starts. Values after an
    unknown flag are taken to be its own (``--split 949,50,1``), so only the flag is named.
    """
    megatron, unknown, stray = [], [], []
    after_flag = False
    for token in extras:
        if token.startswith("-") and not _looks_like_number(token) and token != "--":
            name = token.split("=", 1)[0]
            (megatron if name in MEGATRON_LM_FLAGS else unknown).append(name)
            after_flag = "=" not in token
        elif not after_flag:
            stray.append(token)
    p = []
    if megatron:
        p.append("Megatron-LM flags not implemented by this trainer (refused rather than ignored): "
                 + " ".join(dict.fromkeys(megatron)))
    if unknown:
        p.append("unknown flags (neither this trainer's nor Megatron-LM's; see --help): "
                 + " ".join(dict.fromkeys(unknown)))
    if stray:
        p.append("unexpected arguments (no flag takes them): " + " ".join(stray))
    return p


def _parse_type(annotation: str):
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def parse_config(argv: Sequence[str] | None, world_size: int, ranks_per_node: int | None = None) -> TrainConfig:
    """Parse flags into a :class:`TrainConfig` checked against ``world_size`` (and the launcher's
    ``ranks_per_node`` where known); ConfigError lists all problems."""
    # parse_known_args, not parse_args: argparse's own exit would name the unknown flags in a usage
    # dump and stop before the field checks; here they join every other problem in one ConfigError.
    known, extras = build_parser().parse_known_args(argv)
    ns = vars(known)
    problems: list[str] = unsupported_flag_problems(extras)
    sections = {}
    for section in SECTIONS:
        values = {f.name: ns[f"{section.__name__}.{f.name}"] for f in dataclasses.fields(section)}
        try:
            sections[section] = section(**values)
        except ConfigError as err:
            problems.extend(err.problems)
    if problems:  # layout checks need every section; report field problems first
        raise ConfigError(problems)
    cfg = TrainConfig(model=sections[ModelConfig], parallel=sections[ParallelConfig],
                      optim=sections[OptimConfig], data=sections[DataConfig],
                      checkpoint=sections[CheckpointConfig], run=sections[RunConfig])
    _check(layout_problems(cfg, world_size, ranks_per_node))
    return cfg
