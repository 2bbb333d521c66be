"""The measurements worth repeating, as data: each experiment names its question, GPUs, model, lines,
scenarios and rounds; ``python -m trainer.bench.run NAME`` runs one and writes a dated result file
under docs/bench/ (trainer/bench/run.py)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    """A benchmark model: the pipeline benchmark's model flags (trainer.bench.pipeline)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    train_iters: int
    bf16: bool = True
    vocab_size: int = 50257
    architecture: tuple[str, ...] = ()
    """Trainer flags of the block beyond GPT's (the Llama family's), passed to every line (``--model-flags``)."""
    transformer_impl: str = "local"
    """``--transformer-impl`` of every line: ``local`` (megatron-core's own layers) or
    ``transformer_engine`` (its Transformer Engine spec; CUDA with TE installed only)."""
    model: str = "gpt"
    """The trainer's ``--model``: ``gpt`` (megatron-core's GPTModel) or ``bert`` (its BertModel)."""
    head_weight: float = 2.0
    """Cost of the output head in layers, for the balanced layer split (``--head-weight``)."""
    cpu_stand_in: str = "tiny"
    """The model a CPU dry run (``--device cpu``) runs in its place where a layout names this one
    (``4x1x1@NAME``): the same kind of model in seconds."""

    def describe(self) -> str:
        kind = "BERT" if self.model == "bert" else "GPT"
        if self.architecture:
            kind = f"Llama-style {kind} ({' '.join(self.architecture)})"
        if self.transformer_impl != "local":
            kind += f" with --transformer-impl {self.transformer_impl}"
        return (f"{kind} {self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads, "
                f"seq {self.seq_length}, vocab {self.vocab_size}, mbs {self.micro_batch_size}, "
                f"M={self.num_microbatches}, {'bf16' if self.bf16 else 'fp32'}, {self.train_iters} iterations")

    def bench_fields(self) -> dict[str, object]:
        """This model as fields of the pipeline benchmark's configuration (trainer.bench.lines.BenchConfig):
        what a layout naming it (``--layouts 4x1x1@NAME``) replaces of the call's."""
        # Explicit even for local layers: "auto" would pick Transformer Engine wherever it is installed.
        return {"model": self.model, "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_attention_heads, "seq_length": self.seq_length,
                "vocab_size": self.vocab_size, "micro_batch_size": self.micro_batch_size,
                "num_microbatches": self.num_microbatches, "train_iters": self.train_iters,
                "head_weight": self.head_weight, "bf16": self.bf16,
                "model_flags": (*self.architecture, "--transformer-impl", self.transformer_impl)}

    def bench_args(self) -> list[str]:
        args = []
        for key, value in self.bench_fields().items():
            flag = "--" + key.replace("_", "-")
            if key == "bf16":
                args += [] if value else ["--no-bf16"]
            elif isinstance(value, tuple):
                args += [flag, shlex.join(value)]
            else:
                args += [flag, str(value)]
        return args


def llama_block(query_groups: int, ffn_hidden_size: int) -> tuple[str, ...]:
    """The Llama family's block as Megatron-LM's flags (the AWS Llama-2 line's): RMSNorm, SwiGLU, RoPE
    without a position table, grouped-query attention, untied output layer, no linear biases. RoPE
    fusion off: its fused kernel is Transformer Engine's, and the benchmark's layers are megatron-core's own."""
    return ("--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
            "--no-rope-fusion", "--group-query-attention", "--num-query-groups", str(query_groups),
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--ffn-hidden-size", str(ffn_hidden_size))


MODELS = {
    # The model of every published GPU figure: large enough that a stage's kernels dominate its step on
    # an H100/H200, small enough that 4 stages fit 32 microbatches in memory.
    "gpt16-h2048": Model("gpt16-h2048", 16, 2048, 16, 1024, 2, 32, 10),
    # The same size class with Llama blocks: 16 heads in 4 key/value groups (Llama-2 70B's 8:1 is for 64
    # heads; 4:1 keeps GQA's saving at 16), and SwiGLU's three matrices at 2.6875 h = 5504 (Llama-2's
    # ratio, 11008 / 4096), about the parameters of GPT's two at 4 h.
    "llama16-h2048": Model("llama16-h2048", 16, 2048, 16, 1024, 2, 32, 10, architecture=llama_block(4, 5504),
                           cpu_stand_in="tiny-llama"),
    # The benchmark model with megatron-core's Transformer Engine layer spec (scripts/te builds TE).
    "gpt16-h2048-te": Model("gpt16-h2048-te", 16, 2048, 16, 1024, 2, 32, 10, transformer_impl="transformer_engine"),
    # CPU dry runs: the same command path in seconds.
    "tiny": Model("tiny", 4, 32, 4, 16, 2, 4, 4, bf16=False, vocab_size=128),
    "tiny-llama": Model("tiny-llama", 4, 32, 4, 16, 2, 4, 4, bf16=False, vocab_size=128,
                        architecture=llama_block(2, 64), cpu_stand_in="tiny-llama"),
    # BERT in the same size class: megatron-core's BertModel (masked LM and the binary head, token-type
    # embeddings) with a learned position table of seq 512, BERT's own (its pre-training and Megatron-LM's
    # BERT examples: --seq-length 512 --max-position-embeddings 512; BERT's absolute positions go no
    # further). mbs 4 keeps GPT's 2048 tokens per microbatch, so a microbatch's linear layers cost what
    # GPT's do and the launch overhead weighs the same; vocabulary 30522, BERT's uncased WordPiece. Head
    # weight 1: the head measured on gpt16-h2048 (4xH200: 120.9 ms against 74.6 ms per layer, 1.6 layers at
    # 50257 tokens) scaled to 30522 tokens, plus BERT's transform (one h x h dense): about one layer, so
    # the balanced split is the even 4/4/4/4.
    "bert16-h2048": Model("bert16-h2048", 16, 2048, 16, 512, 4, 32, 10, vocab_size=30522, model="bert",
                          head_weight=1.0, cpu_stand_in="tiny-bert"),
    "tiny-bert": Model("tiny-bert", 4, 32, 4, 16, 2, 4, 4, bf16=False, vocab_size=128, model="bert",
                       head_weight=1.0, cpu_stand_in="tiny-bert"),
}


@dataclass(frozen=True)
class Experiment:
    """One repeatable measurement."""

    name: str
    question: str
    """What the result answers (the dated file's first paragraph)."""
    tool: str
    """``pipeline`` (trainer.bench.pipeline) or ``transport`` (trainer.transport.bench)."""
    gpus: int
    """GPUs of one host; the pipeline's PP where no layouts are given."""
    model: str = "gpt16-h2048"
    cpu_model: str = "tiny"
    """The model of a CPU dry run (``--device cpu``)."""
    lines: tuple[str, ...] = ()
    scenarios: tuple[str, ...] = ("a",)
    """Scenario d runs only where ``--corpus`` is given (the runner says so otherwise)."""
    layouts: tuple[str, ...] = ()
    rounds: int = 1
    args: tuple[str, ...] = ()
    """Further flags of the tool, as given."""


EXPERIMENTS = {e.name: e for e in (
    Experiment(
        "schedule-vs-static",
        "How much of DPP's speed-up over megatron-core is the dynamic schedule, and how much the CUDA "
        "graphs? Megatron-core's best eager 1F1B, the static orders (1F1B, interleaved, ZB-H1) replayed by the "
        "DPP runtime through the same graph slots, and graphed dpp / dpp-zb at v=1 and v=2 (each chunk's slots "
        "the interleaved order's): three ratios per scenario (vs megatron, vs the best graphed static order, "
        "step vs the balanced limit).",
        "pipeline", 4,
        lines=("megatron-1f1b-best", "1f1b-graphs", "interleaved-graphs", "zb-h1-graphs", "dpp-graphs",
               "dpp-zb-graphs", "dpp-graphs-v2", "dpp-zb-graphs-v2"),
        scenarios=("a", "c", "d"), args=("--threads", "4", "--line-timeout", "90")),
    Experiment(
        "layouts",
        "Does DPP's default keep its speed on the layouts a Megatron user runs? Per layout, megatron-core's "
        "best eager configuration against `--use-dpp` alone: PP=4; PP=2 x TP=2 with sequence parallelism; "
        "PP=2 x DP=2 with the overlapped gradient reduction and the distributed optimizer; BERT (bert16-h2048) "
        "at PP=4.",
        "pipeline", 4,
        lines=("megatron-1f1b-best", "dpp-default"),
        layouts=("4x1x1", "2x2x1+sp", "2x1x2+overlap+distopt", "4x1x1@bert16-h2048"),
        args=("--optimizer", "adam", "--threads", "4", "--line-timeout", "120")),
    Experiment(
        "llama",
        "Does DPP's default keep its speed on a Llama-style model (RMSNorm, SwiGLU, RoPE, grouped-query "
        "attention, untied output layer; the size class of the GPT benchmark model)? Megatron-core's best "
        "eager 1F1B against `--use-dpp` alone, PP=4.",
        "pipeline", 4, model="llama16-h2048", cpu_model="tiny-llama",
        lines=("megatron-1f1b-best", "dpp-default"),
        args=("--threads", "4", "--line-timeout", "120")),
    Experiment(
        "transformer-engine",
        "How does DPP compare with megatron-core when both use Transformer Engine's layers (megatron-core's "
        "TE layer spec, bf16, no FP8)? Megatron-core's eager 1F1B and its own CUDA graphs (with TE's RNG "
        "tracker, as Megatron-LM) against eager DPP, eager dpp-zb (W runs TE's own deferred weight GEMMs) and "
        "--use-dpp's default (dpp-zb from the slot graphs, the deferred GEMMs' operands copied out of the "
        "backward pool), beside graphed dpp (the default before split backward was graphed with TE).",
        "pipeline", 4, model="gpt16-h2048-te",
        lines=("megatron-1f1b-best", "megatron-1f1b-graphs", "dpp", "dpp-zb", "dpp-graphs", "dpp-default"),
        args=("--threads", "4", "--line-timeout", "120")),
    Experiment(
        "transport",
        "What does one stage-to-stage message cost on this host, per transport and size, against blocking "
        "torch.distributed send/recv and a raw copy of the same bytes?",
        "transport", 2,
        args=("--sizes", "64K,1M,8M,64M,256M", "--repeats", "5")),
)}
