"""The three jobs of a chain and the environment variables ("knobs") each one takes.

A knob is a shell variable of an sbatch file with a per-recipe default (``NUM_LAYERS=${NUM_LAYERS:-4}``)
and, usually, the trainer flag it feeds. :func:`defaults` reads a recipe into knob values and
:func:`command` builds the exact argv a job runs, which is what the rendered bash must reproduce
(tests/unit/test_render_sbatch.py runs the sbatch files against this function).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainer.names import TRANSPORTS
from workflows.recipes import Recipe
from workflows.shell import Ref, as_text

CONTAINER_WORKDIR = "/workspace/megatron-dpp"  # where containers/Dockerfile installs the package
# Variables templates/_header.sh.j2 sets before any knob: a knob default may refer to them.
HEADER_VARIABLES = ("REPO_DIR", "MODEL", "SIZE", "DEFAULT_OUTPUT_DIR")
RUNS = "runs"  # the repository's folder of run folders (also `workflows.submit --runs-dir`'s default)
# The folder of a job given no OUTPUT_DIR: its own, named after its job id, so that two runs submitted
# by hand never share (and silently resume) each other's checkpoints; a requeued job keeps its id and
# finds its checkpoint again. The one statement of the rule: default_output_dir() below, and the
# sbatch files' shell function of the same name, rendered from this pattern.
DEFAULT_OUTPUT_DIR = "{REPO_DIR}/" + RUNS + "/{MODEL}-{JOB_ID}"


def default_output_dir(repo_dir: str, model: str, job_id: str) -> str:
    """A job's default run folder, e.g. <repository>/runs/gpt-42 (what the sbatch files compute)."""
    return DEFAULT_OUTPUT_DIR.format(REPO_DIR=repo_dir, MODEL=model, JOB_ID=job_id)


# The AWS test case's names (awsome-distributed-training, megatron-lm) for our settings. The sbatch
# files and the driver accept them as aliases; a value that contradicts ours is refused, not ignored.
ALIASES = {"TENSOR_PARALLEL": "TP", "PIPELINE_PARALLEL": "PP", "FSX_MOUNT": "CONTAINER_MOUNTS"}
# Variables the scripts read that are not knobs (no recipe default, no trainer flag of their own).
SCRIPT_VARIABLES = {
    "CONTAINER_MOUNTS": "Pyxis --container-mounts (default: DATA_PATH and OUTPUT_DIR at the same paths)",
    "NCCL_DEBUG": "NCCL's log level for the training ranks (WARN, INFO, TRACE); unset: NCCL's default",
}


def apply_aliases(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``env`` with the AWS names replaced by ours, and a problem for each alias that contradicts."""
    out = dict(env)
    problems = []
    for alias, target in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if out.get(target, value) != value:
            problems.append(f"{alias}={value} and {target}={out[target]} disagree ({alias} is the AWS "
                            f"test case's name for {target}): set one")
        else:
            out[target] = value
    return out, problems


# Knobs the trainer or the scripts read as numbers, with their least value; the switches (0/1) are the
# knobs marked switch=True below, plus RESUME. Checked at submission: a typo fails there, naming the
# knob, instead of in the trainer after the preprocessing and the queue.
INTEGER_MINIMUM = {"GPUS_PER_NODE": 0, "PP": 1, "TP": 1, "NUM_LAYERS": 1, "HIDDEN_SIZE": 1, "NUM_ATTENTION_HEADS": 1,
                   "SEQ_LENGTH": 1, "MAX_POSITION_EMBEDDINGS": 1, "MICRO_BATCH_SIZE": 1, "GLOBAL_BATCH_SIZE": 1,
                   "TRAIN_ITERS": 1, "SAVE_INTERVAL": 1, "LOG_INTERVAL": 1, "SEED": 0, "WORKERS": 1}
CHOICES = {"TRANSPORT": TRANSPORTS, "DEVICE": ("cpu", "cuda")}


def value_problem(knob: str, value: str) -> str | None:
    """Why ``value`` cannot be ``knob``'s (None: it can); the message names both."""
    if knob in INTEGER_MINIMUM:
        least = INTEGER_MINIMUM[knob]
        if not (value.isdigit() and int(value) >= least):
            return f"{knob}={value}: not an integer >= {least}"
    elif knob in SWITCH_KNOBS:
        if value not in ("0", "1"):
            return f"{knob}={value}: must be 0 or 1"
    elif knob in CHOICES:
        if value not in CHOICES[knob]:
            return f"{knob}={value}: not one of {', '.join(CHOICES[knob])}"
    elif knob == "LR":
        try:
            ok = float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            return f"LR={value}: not a positive number"
    return None


def value_problems(env: Mapping[str, str]) -> list[str]:
    """Settings whose value no job could run with, named (checked before anything is submitted).
    An empty value is the recipe's default, as in the sbatch files."""
    return [problem for knob, value in env.items() if value and (problem := value_problem(knob, value))]


@dataclass(frozen=True)
class Knob:
    """One environment-overridable setting of an sbatch file."""

    env: str
    """Shell variable name, e.g. NUM_LAYERS."""
    doc: str
    """One line shown as a comment above the default in the sbatch file."""
    flags: tuple[str, ...] = ()
    """Trainer flags fed with the value (empty: used by the script itself)."""
    switch: bool = False
    """A value-less flag, passed when the variable is 1."""

    def __post_init__(self) -> None:
        if self.switch and len(self.flags) != 1:
            raise ValueError(f"switch knob {self.env} needs exactly one flag, got {self.flags}")


@dataclass(frozen=True)
class Job:
    """One sbatch file of the chain."""

    key: str
    """Short name: preprocess, train, aggregate (also the job-name suffix)."""
    filename: str
    """File under sbatch/ (numbered in chain order, like the AWS test case's)."""
    module: str
    """``python -m`` entry point the job runs."""
    time_limit: str
    """#SBATCH --time of the committed file (sbatch --time=... overrides it)."""
    knobs: tuple[Knob, ...]
    """Settings in definition order (a Ref may only point at an earlier knob)."""
    model_flag: str | None = None
    """Flag that receives MODEL (the recipe selector) ahead of the knobs' flags."""


SHARED = (
    Knob("DATA_PATH", "preprocessed datasets live here (a shared file system on a real cluster)"),
    Knob("OUTPUT_DIR", "checkpoints and traces of this run (default: runs/<model>-<job id>, its own)"),
    Knob("IMAGE", "enroot .sqsh or registry image: set it to run every step under Pyxis"),
    Knob("CONTAINER_WORKDIR", "the package's directory inside IMAGE"),
    Knob("PYTHON", "interpreter on the nodes (or in IMAGE)"),
)
TOKENIZER = (
    Knob("TOKENIZER_TYPE", "tokenizer class", ("--tokenizer-type",)),
    Knob("VOCAB_FILE", "vocabulary, relative to the repository", ("--vocab-file",)),
    Knob("MERGE_FILE", "BPE merges (GPT only)", ("--merge-file",)),
)
DATA_PREFIX_DOC = "dataset path prefix, without the _text_document/_text_sentence suffix"

PREPROCESS = Job("preprocess", "1.data-preprocessing.sbatch", "trainer.preprocess", "00:30:00", SHARED + (
    Knob("INPUT", "jsonl(.xz) corpus, one {\"text\": ...} document a line", ("--input",)),
    Knob("DATA_PREFIX", DATA_PREFIX_DOC, ("--output-prefix",)),
) + TOKENIZER + (
    Knob("APPEND_EOD", "1: end each document with the EOD token", ("--append-eod",), switch=True),
    Knob("SPLIT_SENTENCES", "1: one sentence per dataset item (BERT)", ("--split-sentences",), switch=True),
    Knob("WORKERS", "tokenizer processes", ("--workers",)),
))

TRAIN = Job("train", "2.distributed-training.sbatch", "trainer.train", "02:00:00", SHARED + (
    Knob("DEVICE", "cpu or cuda", ("--device",)),
    Knob("GPUS_PER_NODE", "GPUs per node; 0 starts PP*TP CPU ranks"),
    Knob("USE_DPP", "1: dynamic pipeline schedule; 0: Megatron's 1F1B", ("--use-dpp",), switch=True),
    Knob("PP", "pipeline-parallel size", ("--pipeline-model-parallel-size",)),
    Knob("TP", "tensor-parallel size", ("--tensor-model-parallel-size",)),
    Knob("NUM_LAYERS", "transformer layers", ("--num-layers",)),
    Knob("HIDDEN_SIZE", "model width", ("--hidden-size",)),
    Knob("NUM_ATTENTION_HEADS", "attention heads", ("--num-attention-heads",)),
    Knob("SEQ_LENGTH", "tokens per sample", ("--seq-length",)),
    Knob("MAX_POSITION_EMBEDDINGS", "position table size", ("--max-position-embeddings",)),
    Knob("MICRO_BATCH_SIZE", "samples per microbatch", ("--micro-batch-size",)),
    Knob("GLOBAL_BATCH_SIZE", "samples per iteration", ("--global-batch-size",)),
    Knob("TRAIN_ITERS", "optimiser steps", ("--train-iters",)),
    Knob("LR", "learning rate", ("--lr",)),
    Knob("BF16", "1: bf16 parameters and activations (GPU)", ("--bf16",), switch=True),
    Knob("DATA_PREFIX", DATA_PREFIX_DOC),
    Knob("DATASET", "indexed dataset written by 1.data-preprocessing.sbatch", ("--data-path",)),
) + TOKENIZER + (
    Knob("CHECKPOINT_DIR", "saved to and resumed from (requeue resumes here)", ("--save", "--load")),
    Knob("RESUME", "1: continue a checkpoint another job left in CHECKPOINT_DIR (else that is refused)"),
    Knob("SAVE_INTERVAL", "checkpoint every N iterations", ("--save-interval",)),
    Knob("PROFILE_DIR", "per-rank Chrome traces", ("--profile-dir",)),
    Knob("RUN_NAME", "the run's name in its log lines, metrics and traces (default: the name of OUTPUT_DIR)",
         ("--run-name",)),
    Knob("TRANSPORT", "stage-to-stage transport: " + ", ".join(TRANSPORTS), ("--transport",)),
    Knob("LOG_INTERVAL", "log the loss every N iterations", ("--log-interval",)),
    Knob("SEED", "random seed", ("--seed",)),
    Knob("EXTRA_TRAIN_ARGS", "more trainer flags, split on spaces"),
), model_flag="--model")

AGGREGATE = Job("aggregate", "3.trace-aggregation.sbatch", "trainer.profiling.aggregate", "00:15:00", SHARED + (
    Knob("PROFILE_DIR", "per-rank traces to merge (merged.json, summary.json, PNG land here)",
         ("--benchmark_dir",)),
))

JOBS = (PREPROCESS, TRAIN, AGGREGATE)
KNOB_NAMES = frozenset(k.env for job in JOBS for k in job.knobs)
SWITCH_KNOBS = frozenset({"RESUME"} | {k.env for job in JOBS for k in job.knobs if k.switch})


def defaults(recipe: Recipe) -> dict[str, object]:
    """Every knob's default for ``recipe`` (None: empty, the flag is left out)."""
    tok, shape, training = recipe.tokenization, recipe.shape, recipe.training
    return {
        "DATA_PATH": Ref("REPO_DIR", f"/{RUNS}/data"),
        "OUTPUT_DIR": Ref("DEFAULT_OUTPUT_DIR"),
        "IMAGE": None,
        "CONTAINER_WORKDIR": CONTAINER_WORKDIR,
        "PYTHON": "python3",
        "INPUT": recipe.corpus,
        "DATA_PREFIX": Ref("DATA_PATH", f"/{tok.dataset_dir}/sample"),
        "TOKENIZER_TYPE": tok.tokenizer_type,
        "VOCAB_FILE": tok.vocab_file,
        "MERGE_FILE": tok.merge_file,
        "APPEND_EOD": tok.append_eod,
        "SPLIT_SENTENCES": tok.split_sentences,
        "WORKERS": recipe.preprocess_workers,
        "DEVICE": recipe.device,
        "GPUS_PER_NODE": recipe.gpus_per_node,
        "USE_DPP": recipe.use_dpp,
        "PP": recipe.parallel.pipeline,
        "TP": recipe.parallel.tensor,
        "NUM_LAYERS": shape.num_layers,
        "HIDDEN_SIZE": shape.hidden_size,
        "NUM_ATTENTION_HEADS": shape.num_attention_heads,
        "SEQ_LENGTH": shape.seq_length,
        "MAX_POSITION_EMBEDDINGS": shape.max_position_embeddings,
        "MICRO_BATCH_SIZE": training.micro_batch_size,
        "GLOBAL_BATCH_SIZE": training.global_batch_size,
        "TRAIN_ITERS": training.train_iters,
        "LR": training.lr,
        "BF16": recipe.bf16,
        "DATASET": Ref("DATA_PREFIX", tok.dataset_suffix),
        "CHECKPOINT_DIR": Ref("OUTPUT_DIR", "/checkpoints"),
        "RESUME": False,
        "SAVE_INTERVAL": training.save_interval,
        "PROFILE_DIR": Ref("OUTPUT_DIR", "/traces"),
        "RUN_NAME": Ref("OUTPUT_DIR", basename=True),
        "TRANSPORT": recipe.transport,
        "LOG_INTERVAL": training.log_interval,
        "SEED": training.seed,
        "EXTRA_TRAIN_ARGS": None,
    }


def resolve(job: Job, recipe: Recipe, env: Mapping[str, str]) -> dict[str, str]:
    """Knob values as the job's bash computes them: a non-empty ``env`` entry wins over the default.

    ``env`` must hold REPO_DIR; DEFAULT_OUTPUT_DIR comes from SLURM_JOB_ID (``<pid>`` without one).
    """
    env, _problems = apply_aliases({k: v for k, v in env.items() if v})  # the bash refuses a contradiction
    values = {"REPO_DIR": env["REPO_DIR"], "MODEL": recipe.model, "SIZE": recipe.size}
    values["DEFAULT_OUTPUT_DIR"] = default_output_dir(env["REPO_DIR"], recipe.model, env.get("SLURM_JOB_ID", "<pid>"))
    recipe_defaults = defaults(recipe)
    for knob in job.knobs:
        default = recipe_defaults[knob.env]
        fallback = default.resolve(values) if isinstance(default, Ref) else as_text(default)
        values[knob.env] = env.get(knob.env) or fallback
    return values


def knob_arguments(job: Job, values: Mapping[str, str]) -> list[str]:
    """The recipe-driven part of a job's argv (what the sbatch file collects in ``ARGS``)."""
    args = [job.model_flag, values["MODEL"]] if job.model_flag else []
    for knob in job.knobs:
        value = values[knob.env]
        if knob.switch:
            args += list(knob.flags) if value == "1" else []
        elif value:
            for flag in knob.flags:
                args += [flag, value]
    return args
