"""Named training recipes: typed configs, one function per model, each in a CPU-demo and a GPU size.

A recipe is the single source of truth for every command line the Slurm chain runs: the sbatch
templates print its values as ``${VAR:-default}`` defaults (workflows/jobs.py maps fields to
variables), and ``workflows.submit`` only overrides those variables through the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainer.names import FILE_TOKENIZERS
from trainer.problems import raise_if_any

SIZES = ("cpu", "gpu")
CORPUS = "datasets/python-docs.jsonl.xz"  # shipped offline corpus (datasets/ README gives provenance)


def _check(errors: list[str], owner: str) -> None:
    raise_if_any(errors, f"invalid {owner}")


@dataclass(frozen=True)
class ModelShape:
    """Transformer size, with Megatron-LM's flag names."""

    num_layers: int
    """--num-layers: transformer layers in the whole model (split across pipeline stages)."""
    hidden_size: int
    """--hidden-size: model width."""
    num_attention_heads: int
    """--num-attention-heads: must divide hidden_size."""
    seq_length: int
    """--seq-length: tokens per sample."""
    max_position_embeddings: int
    """--max-position-embeddings: at least seq_length."""

    def __post_init__(self) -> None:
        errors = [f"{k}={v} must be >= 1" for k, v in vars(self).items() if v < 1]
        if not errors and self.hidden_size % self.num_attention_heads:
            errors.append(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.max_position_embeddings < self.seq_length:
            errors.append(
                f"max_position_embeddings={self.max_position_embeddings} < seq_length={self.seq_length}"
            )
        _check(errors, "ModelShape")


@dataclass(frozen=True)
class Parallelism:
    """Model-parallel layout; data parallelism fills whatever ranks remain."""

    pipeline: int
    """--pipeline-model-parallel-size (PP)."""
    tensor: int = 1
    """--tensor-model-parallel-size (TP); TP groups always stay within one node."""

    def __post_init__(self) -> None:
        _check([f"{k}={v} must be >= 1" for k, v in vars(self).items() if v < 1], "Parallelism")


@dataclass(frozen=True)
class TrainingSchedule:
    """Batch sizes, length, optimiser and checkpoint cadence."""

    micro_batch_size: int
    """--micro-batch-size: samples per microbatch per data-parallel rank."""
    global_batch_size: int
    """--global-batch-size: samples per iteration; a multiple of micro_batch_size."""
    train_iters: int
    """--train-iters: optimiser steps."""
    lr: float
    """--lr: peak learning rate."""
    save_interval: int
    """--save-interval: checkpoint every N iterations (and always on SIGUSR1/SIGTERM)."""
    log_interval: int = 1
    """--log-interval: print the loss every N iterations."""
    seed: int = 1234
    """--seed: the requeue test relies on it to reproduce an uninterrupted run's loss."""

    def __post_init__(self) -> None:
        errors = [f"{k}={v} must be > 0" for k, v in vars(self).items() if k != "seed" and v <= 0]
        if not errors and self.global_batch_size % self.micro_batch_size:
            errors.append(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        _check(errors, "TrainingSchedule")


@dataclass(frozen=True)
class Tokenization:
    """How the corpus becomes a Megatron indexed dataset, and the tokenizer training reads back."""

    tokenizer_type: str
    """--tokenizer-type: a file tokenizer of trainer/names.py (Megatron-LM's names)."""
    vocab_file: str
    """--vocab-file, relative to the repository (or container work) directory."""
    merge_file: str | None
    """--merge-file for BPE tokenizers; None for WordPiece."""
    dataset_dir: str
    """Sub-folder of DATA_PATH that holds this tokenizer's dataset (gpt2, bert)."""
    split_sentences: bool = False
    """--split-sentences: BERT's sentence-order objective needs sentence boundaries."""
    append_eod: bool = True
    """--append-eod: separate documents with the end-of-document token."""

    TOKENIZERS = FILE_TOKENIZERS

    def __post_init__(self) -> None:
        errors = []
        if self.tokenizer_type not in self.TOKENIZERS:
            errors.append(f"tokenizer_type={self.tokenizer_type!r} is not one of {self.TOKENIZERS}")
        if (self.tokenizer_type == "GPT2BPETokenizer") != (self.merge_file is not None):
            errors.append(f"merge_file={self.merge_file!r} must be set exactly for GPT2BPETokenizer")
        if not self.dataset_dir or "/" in self.dataset_dir:
            errors.append(f"dataset_dir={self.dataset_dir!r} must be one folder name")
        _check(errors, "Tokenization")

    @property
    def dataset_suffix(self) -> str:
        """What preprocess appends to the output prefix (Megatron's naming: key `text`, level)."""
        return "_text_sentence" if self.split_sentences else "_text_document"


@dataclass(frozen=True)
class Recipe:
    """Everything the three jobs of a chain need, sized for one kind of node."""

    model: str
    """--model: gpt or bert."""
    size: str
    """cpu (tiny demo, gloo, runs on the local cluster) or gpu (NCCL, bf16)."""
    shape: ModelShape
    """Transformer size."""
    parallel: Parallelism
    """PP/TP layout."""
    training: TrainingSchedule
    """Batches, iterations, optimiser, checkpoints."""
    tokenization: Tokenization
    """Tokenizer and dataset naming."""
    nodes: int
    """Default node count of the training job (sbatch --nodes / submit --nodes)."""
    gpus_per_node: int = 0
    """GPUs per node; 0 runs PP*TP CPU ranks spread over the nodes."""
    corpus: str = CORPUS
    """Input jsonl(.xz) of {"text": ...} documents, relative to the repository."""
    preprocess_workers: int = 2
    """--workers of the preprocessing job."""
    use_dpp: bool = True
    """--use-dpp: the dynamic pipeline schedule (False: Megatron's 1F1B)."""
    transport: str = "auto"
    """--transport: auto picks shm within a node and gloo/nccl across nodes."""
    bf16: bool = False
    """--bf16 (GPU sizes only)."""

    MODELS = ("gpt", "bert")

    def __post_init__(self) -> None:
        errors = []
        if self.model not in self.MODELS:
            errors.append(f"model={self.model!r} is not one of {self.MODELS}")
        if self.size not in SIZES:
            errors.append(f"size={self.size!r} is not one of {SIZES}")
        if self.nodes < 1:
            errors.append(f"nodes={self.nodes} must be >= 1")
        if self.gpus_per_node < 0 or (self.size == "gpu") != (self.gpus_per_node > 0):
            errors.append(f"gpus_per_node={self.gpus_per_node} must be > 0 exactly for size 'gpu'")
        if self.bf16 and self.size != "gpu":
            errors.append("bf16=True needs size 'gpu'")
        if self.preprocess_workers < 1:
            errors.append(f"preprocess_workers={self.preprocess_workers} must be >= 1")
        _check(errors, f"Recipe {self.model}/{self.size}")

    @property
    def key(self) -> str:
        """The MODEL/SIZE pair the sbatch files select defaults with."""
        return f"{self.model}/{self.size}"

    @property
    def device(self) -> str:
        return "cuda" if self.size == "gpu" else "cpu"


def gpt(size: str = "cpu") -> Recipe:
    """GPT with GPT-2 BPE. cpu: 4x64 demo over 2 nodes; gpu: the 16x2048 benchmark of docs/benchmarks.md#reference-megatron-core-alone-on-4-h200s."""
    tokenization = Tokenization(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file="datasets/gpt2/vocab.json",
        merge_file="datasets/gpt2/merges.txt",
        dataset_dir="gpt2",
    )
    if size == "gpu":
        return Recipe(
            model="gpt", size="gpu", nodes=1, gpus_per_node=4, bf16=True, preprocess_workers=16,
            shape=ModelShape(16, 2048, 16, 1024, 1024),
            parallel=Parallelism(pipeline=4),
            training=TrainingSchedule(2, 64, 100, 1.5e-4, save_interval=50, log_interval=10),
            tokenization=tokenization,
        )
    return Recipe(
        model="gpt", size=size, nodes=2,
        shape=ModelShape(4, 64, 4, 64, 64),
        parallel=Parallelism(pipeline=2),
        training=TrainingSchedule(2, 16, 20, 1e-3, save_interval=5),
        tokenization=tokenization,
    )


def bert(size: str = "cpu") -> Recipe:
    """BERT with lower-case WordPiece and sentence splitting; same sizes as :func:`gpt`'s."""
    tokenization = Tokenization(
        tokenizer_type="BertWordPieceLowerCase",
        vocab_file="datasets/bert/vocab.txt",
        merge_file=None,
        dataset_dir="bert",
        split_sentences=True,
    )
    if size == "gpu":
        return Recipe(
            model="bert", size="gpu", nodes=1, gpus_per_node=4, bf16=True, preprocess_workers=16,
            shape=ModelShape(24, 1024, 16, 512, 512),
            parallel=Parallelism(pipeline=4),
            training=TrainingSchedule(4, 64, 100, 1e-4, save_interval=50, log_interval=10),
            tokenization=tokenization,
        )
    return Recipe(
        model="bert", size=size, nodes=2,
        shape=ModelShape(4, 64, 4, 64, 64),
        parallel=Parallelism(pipeline=2),
        training=TrainingSchedule(2, 16, 20, 1e-3, save_interval=5),
        tokenization=tokenization,
    )


RECIPES: dict[str, Callable[[str], Recipe]] = {"gpt": gpt, "bert": bert}
DEFAULT = ("gpt", "cpu")  # what the committed sbatch files run when MODEL/SIZE are unset


def get(model: str, size: str = "cpu") -> Recipe:
    """The named recipe; ValueError naming the bad value otherwise."""
    if model not in RECIPES:
        raise ValueError(f"unknown recipe {model!r}; choose one of {', '.join(RECIPES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return RECIPES[model](size)


def all_recipes() -> list[Recipe]:
    """Every shipped recipe, default first (the sbatch files' case statement follows this order)."""
    ordered = [get(*DEFAULT)]
    ordered += [get(m, s) for m in RECIPES for s in SIZES if (m, s) != DEFAULT]
    return ordered
