"""Typed training configuration with Megatron-LM's flag names (docs/training.md#flags).

Each dataclass validates its own fields in ``__post_init__``; :func:`layout_problems` checks what
needs the world size (known from the launcher's environment before any process group exists).
:func:`parse_config` runs both and raises one :class:`ConfigError` listing *every* offending value,
so ``python -m trainer.train`` can exit 2 with one readable message and no traceback.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib.util
import inspect
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from trainer.cli import OneLineParser
from trainer.data.megatron_datasets import parse_blend
from trainer.data.split import MEGATRON_DEFAULT_SPLIT, parse_split
from trainer.data.varlen import parse_length_distribution
from trainer.layer_split import split_problems
from trainer.megatron_lm_flags import MEGATRON_LM_FLAGS
from trainer.names import MODEL_FILE_TOKENIZERS, TOKENIZERS, TRANSPORTS, TokenizerType, Transport
from trainer.node_addresses import read_node_ips
from trainer.stall_injection import stall_problems

DPP_POLICIES = ("auto", "dpp", "dpp-zb", "zb-h1")
DECAY_STYLES = ("constant", "linear", "cosine")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")  # megatron-core's AttnBackend names
# Environment switches megatron-core sets for Transformer Engine per backend (LanguageModule's
# _set_attention_backend), in the order NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN.
NVTE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
NVTE_ATTENTION_VALUES = {"auto": (1, 1, 1), "flash": (1, 0, 0), "fused": (0, 1, 0), "unfused": (0, 0, 1),
                         "local": (0, 0, 0)}
DEFAULT_TRAIN_ITERS = 10  # without --train-iters or --train-samples (Megatron-LM requires one)


class ConfigError(ValueError):
    """One or more bad settings; the message names every one of them."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))


def _check(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer (``--model`` picks GPT or BERT from megatron-core)."""

    model: Literal["gpt", "bert"] = "gpt"
    """Which megatron-core model: GPTModel (causal LM) or BertModel (masked LM + binary head)."""
    num_layers: int = 2
    """Transformer layers in the whole model (``--num-layers``)."""
    hidden_size: int = 64
    """Hidden width (``--hidden-size``)."""
    num_attention_heads: int = 4
    """Attention heads (``--num-attention-heads``); divisible by the TP size."""
    ffn_hidden_size: int | None = None
    """MLP width (``--ffn-hidden-size``); None means 4 x hidden_size, Megatron's default."""
    seq_length: int = 64
    """Tokens per sample (``--seq-length``)."""
    max_position_embeddings: int | None = None
    """Learned position table size (``--max-position-embeddings``); None means seq_length."""
    vocab_size: int = 1024
    """Vocabulary size for ``--mock-data`` / NullTokenizer; real tokenizers bring their own."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this x TP, as Megatron does."""
    hidden_dropout: float = 0.1
    """Dropout after attention/MLP (``--hidden-dropout``)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (``--attention-dropout``)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of reusing the input embedding (Megatron's flag)."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer spec: local always works; TE when importable ("auto" picks TE on CUDA if present)."""
    recompute_activations: bool = False
    """Megatron-LM's shorthand for ``--recompute-granularity selective`` (``--recompute-activations``)."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recompute (``--recompute-granularity``, TransformerConfig's field): full recomputes
    whole transformer layers in the backward (needs --recompute-method and --recompute-num-layers),
    selective only the core attention (megatron-core's default recompute module). None: off."""
    recompute_method: Literal["uniform", "block"] | None = None
    """Which layers full recompute covers (``--recompute-method``): uniform = every layer, in groups of
    --recompute-num-layers; block = the first --recompute-num-layers layers of each model chunk."""
    recompute_num_layers: int | None = None
    """Group size (uniform) or layers per chunk (block) of full recompute (``--recompute-num-layers``)."""
    init_method_std: float = 0.02
    """Standard deviation of the zero-mean normal initialisation (``--init-method-std``, Megatron-LM's
    default 0.02); megatron-core scales it by 1/sqrt(2 x layers) for the output projections."""
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    """Megatron-LM's ``--attention-backend`` (megatron-core's ``TransformerConfig.attention_backend``):
    auto = the layer spec's default (Transformer Engine picks its kernel); flash / fused / unfused =
    that kernel of Transformer Engine's DotProductAttention (needs TE on CUDA; flash also the
    flash-attn package), forced as megatron-core forces it (NVTE_FLASH/FUSED/UNFUSED_ATTN); local =
    megatron-core's own attention, i.e. the local layer spec."""
    use_flash_attn: bool = False
    """Megatron-LM's ``--use-flash-attn`` (FlashAttention): here the same as ``--attention-backend
    flash`` (megatron-core models take the backend from that setting)."""

    # ---- Llama-family architecture (Megatron-LM's flags and defaults; checked by _llama_problems) ----
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """``--normalization`` (TransformerConfig.normalization): LayerNorm, or RMSNorm as Llama uses (the
    local spec builds torch.nn.RMSNorm through megatron-core's WrappedTorchNorm)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm (``--norm-epsilon``, TransformerConfig.layernorm_epsilon)."""
    swiglu: bool = False
    """``--swiglu``: gated linear unit with SiLU in the MLP (Llama's SwiGLU). Without
    --ffn-hidden-size the MLP width is then int(4 h x 2/3 / 64) x 64, as Megatron-LM sets it."""
    disable_bias_linear: bool = False
    """``--disable-bias-linear``: no biases in the attention and MLP linears (Llama has none)."""
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """``--position-embedding-type``: a learned position table (GPT's), rotary embeddings applied to
    queries and keys (``rope``, Llama's; no table), or none."""
    no_position_embedding: bool = False
    """``--no-position-embedding``: Megatron-LM's deprecated way to drop the learned table; as there,
    only accepted together with --position-embedding-type rope (where it changes nothing)."""
    rotary_base: int = 10000
    """RoPE base period (``--rotary-base``)."""
    rotary_percent: float = 1.0
    """Share of each head's dimensions that RoPE rotates (``--rotary-percent``, in (0, 1])."""
    group_query_attention: bool = False
    """``--group-query-attention``: keys and values have --num-query-groups heads, shared by
    --num-attention-heads / --num-query-groups query heads each (Llama-2 70B: 64 heads, 8 groups)."""
    num_query_groups: int = 1
    """Key/value head groups with --group-query-attention (``--num-query-groups``); ignored without it,
    as in Megatron-LM."""
    masked_softmax_fusion: bool = True
    """Megatron's fused scale-mask-softmax kernel where it is built (``--no-masked-softmax-fusion``
    turns it off; on CPU, or without the kernel, the unfused softmax runs either way)."""
    rope_fusion: bool = True
    """Transformer Engine's fused RoPE where it is used (``--no-rope-fusion`` turns it off; the local
    spec applies RoPE unfused either way)."""
    use_mcore_models: bool = False
    """``--use-mcore-models``: accepted for Megatron-LM command lines; megatron-core's models are the
    only ones this trainer builds."""
    # ---- end of the Llama-family block ----

    def __post_init__(self) -> None:
        p = [f"--{n.replace('_', '-')}={getattr(self, n)} must be >= 1"
             for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                       "make_vocab_size_divisible_by") if getattr(self, n) < 1]
        if self.model not in ("gpt", "bert"):
            p.append(f"--model={self.model!r} must be gpt or bert")
        if self.hidden_size % max(self.num_attention_heads, 1):
            p.append(f"--hidden-size={self.hidden_size} is not divisible by "
                     f"--num-attention-heads={self.num_attention_heads}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            p.append(f"--ffn-hidden-size={self.ffn_hidden_size} must be >= 1")
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            p.append(f"--max-position-embeddings={self.max_position_embeddings} is smaller than "
                     f"--seq-length={self.seq_length}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"--{name.replace('_', '-')}={getattr(self, name)} must be in [0, 1)")
        if not self.init_method_std > 0:
            p.append(f"--init-method-std={self.init_method_std} must be > 0")
        p.extend(self._recompute_problems())
        p.extend(_llama_problems(self))
        if self.attention_backend not in ATTENTION_BACKENDS:
            p.append(f"--attention-backend={self.attention_backend!r} must be one of {', '.join(ATTENTION_BACKENDS)}")
        elif self.use_flash_attn and self.attention_backend not in ("auto", "flash"):
            p.append(f"--use-flash-attn asks for the flash backend but --attention-backend={self.attention_backend}: "
                     "give one of them")
        _check(p)

    def _recompute_problems(self) -> list[str]:
        """Megatron-LM's and megatron-core's recompute rules; and, since megatron-core would silently
        ignore a method or layer count without a granularity, that is refused too."""
        granularity, method, layers = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        p = []
        if granularity not in (None, "full", "selective"):
            p.append(f"--recompute-granularity={granularity!r} must be full or selective")
        if method not in (None, "uniform", "block"):
            p.append(f"--recompute-method={method!r} must be uniform or block")
        if layers is not None and layers < 1:
            p.append(f"--recompute-num-layers={layers} must be >= 1")
        if self.recompute_activations and granularity == "full":
            # Megatron-LM would quietly turn full into selective; a contradiction is named instead.
            p.append("--recompute-activations means --recompute-granularity selective, not full: give one of them")
        if self.recompute == "full":
            p.extend(f"--recompute-granularity full needs {flag}" for flag, value in
                     (("--recompute-method uniform|block", method), ("--recompute-num-layers N", layers))
                     if value is None)
        elif self.recompute == "selective":
            p.extend(f"{flag}={value} applies to --recompute-granularity full only, not selective"
                     for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers))
                     if value is not None)
        else:
            p.extend(f"{flag}={value} needs --recompute-granularity full (without it nothing is recomputed)"
                     for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers))
                     if value is not None)
        return p

    @property
    def recompute(self) -> str | None:
        """The recompute granularity megatron-core gets (--recompute-activations means selective)."""
        return "selective" if self.recompute_activations else self.recompute_granularity

    @property
    def attention(self) -> str:
        """The attention backend megatron-core gets (--use-flash-attn means flash)."""
        return "flash" if self.use_flash_attn else self.attention_backend

    @property
    def ffn_size(self) -> int:
        """--ffn-hidden-size, else Megatron-LM's default: 4 h, or int(4 h x 2/3 / 64) x 64 with --swiglu."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, vocab_size: int, tensor_parallel: int) -> int:
        """Megatron's padding: next multiple of make_vocab_size_divisible_by x TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-vocab_size // multiple) * multiple


# ---- Llama-family architecture: the checks of ModelConfig's Llama block ----------------------------
LLAMA_DEFAULTS = {"normalization": "LayerNorm", "swiglu": False, "disable_bias_linear": False,
                  "position_embedding_type": "learned_absolute", "group_query_attention": False}


def _llama_problems(m: ModelConfig) -> list[str]:
    """Megatron-LM's rules for the Llama-family flags (validate_args), refused up front."""
    p = []
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        p.append(f"--normalization={m.normalization!r} must be LayerNorm or RMSNorm")
    if not m.norm_epsilon > 0:
        p.append(f"--norm-epsilon={m.norm_epsilon} must be > 0")
    if m.position_embedding_type not in ("learned_absolute", "rope", "none"):
        p.append(f"--position-embedding-type={m.position_embedding_type!r} must be learned_absolute, rope or none")
    if m.no_position_embedding and m.position_embedding_type != "rope":
        # Megatron-LM raises the same: the flag is deprecated except beside rope.
        p.append("--no-position-embedding is deprecated, use --position-embedding-type (it is accepted only "
                 f"with --position-embedding-type rope; got {m.position_embedding_type})")
    if m.rotary_base < 1:
        p.append(f"--rotary-base={m.rotary_base} must be >= 1")
    if not 0.0 < m.rotary_percent <= 1.0:
        p.append(f"--rotary-percent={m.rotary_percent} must be in (0, 1]")
    if m.group_query_attention:
        if m.num_query_groups < 1:
            p.append(f"--num-query-groups={m.num_query_groups} must be >= 1")
        elif m.num_attention_heads % m.num_query_groups:
            p.append(f"--num-attention-heads={m.num_attention_heads} is not divisible by "
                     f"--num-query-groups={m.num_query_groups}")
    if m.swiglu and m.ffn_hidden_size is None and m.ffn_size < 1:
        p.append(f"--swiglu without --ffn-hidden-size gives int(4 x {m.hidden_size} x 2/3 / 64) x 64 = 0: "
                 "give --ffn-hidden-size")
    llama = [f"--{name.replace('_', '-')}" for name, default in LLAMA_DEFAULTS.items() if getattr(m, name) != default]
    if llama and m.model != "gpt":
        p.append(f"{' '.join(llama)} are implemented for --model gpt only (Llama-family GPT models)")
    return p


def llama_layout_problems(cfg: TrainConfig) -> list[str]:
    """The Llama-family flags against the parallel layout and the layer spec."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    p = []
    if m.group_query_attention and m.num_query_groups >= 1 and m.num_query_groups % tp:
        p.append(f"--num-query-groups={m.num_query_groups} is not divisible by --tensor-model-parallel-size={tp} "
                 "(each TP rank holds whole key/value groups)")
    if m.position_embedding_type == "rope" and (m.hidden_size // m.num_attention_heads) % 2:
        p.append(f"--position-embedding-type rope needs an even head size (--hidden-size / --num-attention-heads "
                 f"= {m.hidden_size // m.num_attention_heads})")
    return p


def llama_identity(m: ModelConfig) -> dict[str, object]:
    """The architecture a checkpoint of this model must share (trainer.checkpoint.run_identity)."""
    return {"normalization": m.normalization, "swiglu": m.swiglu, "add_bias_linear": not m.disable_bias_linear,
            "position_embedding_type": m.position_embedding_type,
            "num_query_groups": m.num_query_groups if m.group_query_attention else m.num_attention_heads}
# ---- end of the Llama-family checks ----


@dataclass(frozen=True)
class ParallelConfig:
    """How the model and batch are split over ranks, and how the pipeline is scheduled."""

    tensor_model_parallel_size: int = 1
    """TP size (``--tensor-model-parallel-size``); TP groups stay within a node."""
    pipeline_model_parallel_size: int = 1
    """PP size (``--pipeline-model-parallel-size``): number of pipeline stages."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per model chunk; enables interleaving (VP) when smaller than layers per stage."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP ranks (``--use-distributed-optimizer``)."""
    use_dpp: bool = False
    """Run the dynamic pipeline schedule instead of 1F1B (``--use-dpp``)."""
    dpp_max_inflight: int | None = None
    """DPP cap on forwards whose activations are held; None means 1F1B's per-stage cap."""
    dpp_cap_factor: float = 1.0
    """Multiplies each stage's 1F1B in-flight cap, rounded down (``--dpp-cap-factor``): 1.5 at PP=4
    gives 6/4/3/1. Headroom on the early stages hides the stage-to-stage round trip (a stage at
    1F1B's cap must wait for its oldest microbatch's gradient before the next forward) at the
    memory of the extra activations; the last stage keeps 1F1B's cap (its F and B are adjacent)."""
    dpp_max_queued_ops: int | None = None
    """How many of its queued ops a DPP stage's host may have unfinished on the GPU before it decides
    the next (``--dpp-max-queued-ops``; trainer/pipeline/run_ahead.py): decisions near GPU time
    instead of at host time, so a forward whose input is still being computed upstream does not
    hold back a ready backward on the stream. 0 = unbounded. Default: 1 with --dpp-cuda-graphs (on
    4xH100, issue-12 model: 482 ms/iteration at 1, 524 at 2, 559 unbounded; docs/benchmarks.md), 0
    otherwise (eager DPP not measured with it). CUDA only in effect."""
    dpp_fill_transit: bool = True
    """dpp-zb: while every ready input gradient is still on its way to this GPU (its header comes
    when the neighbour *queued* the op making it), run a deferred W meanwhile, and a landed gradient's
    I before a travelling one's (``--no-dpp-fill-transit``: decide on headers alone, as before the
    eleventh session; for measurements). trainer/schedule/dynamic.py, DynamicOptions.fill_transit."""
    dpp_policy: Literal["auto", "dpp", "dpp-zb", "zb-h1"] = "auto"
    """Policy of the DPP runtime (``--dpp-policy``): dpp (greedy), dpp-zb (greedy with split backward:
    deferred weight gradients fill idle time), zb-h1 (static zero-bubble schedule; also selects it for
    the runtime's non-DPP CPU path), auto (the default: dpp-zb with --dpp-cuda-graphs where its split
    backward is possible, else dpp -- what measured fastest at equal memory, eleventh session,
    docs/schedules.md; the log's layout line says which ran and why). Split backward needs
    megatron-core's local layer spec."""
    dpp_cuda_graphs: bool = False
    """Replay the forward and backward of every chunk's transformer block from CUDA graphs, one graph
    pair per in-flight activation slot (``--dpp-cuda-graphs``; trainer/pipeline/cuda_graphs.py): removes
    the launch overhead that makes small-microbatch forwards host-bound. GPT on CUDA with --use-dpp
    --dpp-policy dpp or dpp-zb (F, I and W graphs per slot), TP 1 and dropout 0; costs GPU memory per
    slot."""
    dpp_recompute_slots: tuple[int, ...] = ()
    """With --dpp-cuda-graphs: how many of a stage's graph slots (of each chunk's, at v > 1) recompute
    the core attention in their backward graph (selective recompute, per slot), listed per stage from
    stage 0, comma-separated;
    stages not listed: none (``--dpp-recompute-slots 1`` = one slot of stage 0's). A recomputing slot
    holds ~55% of a slot's activations on the issue-12 model for a share of the recompute's GPU time, so
    the stage that decides peak memory can give up memory where it costs least; forwards take a
    slot that keeps its activations when one is free. --recompute-activations recomputes in every slot
    and every eager op instead; the two are exclusive."""
    cuda_graph_impl: Literal["none", "local"] = "none"
    """megatron-core's own CUDA graphs for its schedules, as Megatron-LM's ``--cuda-graph-impl local``:
    every transformer layer's forward and backward recorded per in-flight microbatch during the first
    ``--cuda-graph-warmup-steps`` steps' schedule, then replayed (megatron.core.transformer.cuda_graphs).
    CUDA, not with --use-dpp (the DPP runtime's graphs are --dpp-cuda-graphs), one sequence length.
    "transformer_engine" and "full_iteration" need Transformer Engine / are not offered here."""
    cuda_graph_warmup_steps: int = 3
    """Eager steps of each graphed layer before megatron-core records its graphs (as Megatron-LM)."""
    transport: Transport = "auto"
    """Stage-to-stage transport (``--transport``): shm within a node, nccl/gloo across."""
    dpp_timeout_s: float = 300.0
    """Watchdog: a stage that can run nothing for this long fails naming what it waits for."""
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Backend of the default process group (Megatron-LM's ``--distributed-backend``): auto = nccl
    on CUDA, gloo on CPU. gloo on CUDA lets several ranks share one GPU (NCCL refuses that), e.g. to
    run the DPP runtime with the CUDA IPC transport on a single-GPU machine."""
    num_virtual_stages_per_pipeline_rank: int | None = None
    """Model chunks per stage (Megatron-LM's flag); the way to ask for VP with an uneven split,
    where layers per virtual stage differ between stages. Exclusive with
    --num-layers-per-virtual-pipeline-stage."""
    decoder_first_pipeline_num_layers: int | None = None
    """Transformer layers on the first stage (Megatron-LM's flag; megatron-core's
    num_layers_in_first_pipeline_stage); None = even split. The rest is spread over the middle stages."""
    decoder_last_pipeline_num_layers: int | None = None
    """Transformer layers on the last stage (Megatron-LM's flag; num_layers_in_last_pipeline_stage),
    e.g. one fewer when the output head over a large vocabulary weighs like a layer or two."""
    overlap_p2p_comm: bool = True
    """megatron-core's interleaved schedule overlaps P2P with compute (Megatron-LM's default; switched
    off by its flag --no-overlap-p2p-communication). Like Megatron-LM, only used with VP; without VP
    overlap is off. batch_p2p_comm (batch_isend_irecv) is its negation, as Megatron-LM sets it."""
    sequence_parallel: bool = False
    """Megatron-LM's ``--sequence-parallel`` (TransformerConfig.sequence_parallel): with TP > 1 the
    layer norms, dropouts and residuals work on 1/TP of the sequence; activations between layers, and
    between pipeline stages, are [seq/TP, batch, hidden]. Needs --tensor-model-parallel-size > 1
    (Megatron-LM would switch it off with a warning) and --seq-length divisible by TP."""
    overlap_grad_reduce: bool = False
    """Megatron-LM's ``--overlap-grad-reduce`` (megatron-core DDP's overlap_grad_reduce): each model
    chunk's data-parallel gradient reduction is launched asynchronously, bucket by bucket, while its
    last backward still runs (instead of all at once in finalize_model_grads), and awaited in
    finalize_model_grads. Buckets of max(40M, 1M x DP) parameters, as Megatron-LM."""
    overlap_param_gather: bool = False
    """Megatron-LM's ``--overlap-param-gather`` (megatron-core DDP's overlap_param_gather): with the
    distributed optimizer, the all-gather of the updated parameters is not done inside the optimizer
    step but bucket by bucket, asynchronously, from forward pre-hooks when the next forward first
    uses them (each bucket's wait dispatches the next); a checkpoint save gathers them all first.
    Needs --use-distributed-optimizer and --overlap-grad-reduce, as in Megatron-LM."""
    batch_p2p_sync: bool = True
    """megatron-core syncs the device after each batched P2P (batch_isend_irecv), a workaround for old
    PyTorch; --no-batch-p2p-sync turns it off (Megatron-LM has no flag; the name follows its
    --no-<field> convention for TransformerConfig.batch_p2p_sync). Only megatron-core's schedules use it."""

    @property
    def max_queued_ops(self) -> int:
        """--dpp-max-queued-ops as the runtime uses it (its default resolved: 1 with graphs, else 0)."""
        if self.dpp_max_queued_ops is not None:
            return self.dpp_max_queued_ops
        return 1 if self.dpp_cuda_graphs else 0

    def _dpp_problems(self) -> list[str]:
        """The DPP runtime's own knobs: policy, caps."""
        p: list[str] = []
        if self.dpp_max_queued_ops is not None and self.dpp_max_queued_ops < 0:
            p.append(f"--dpp-max-queued-ops={self.dpp_max_queued_ops} must be >= 0")
        elif self.dpp_max_queued_ops and not self.use_dpp:
            p.append(f"--dpp-max-queued-ops={self.dpp_max_queued_ops} applies to --use-dpp")
        if not (math.isfinite(self.dpp_cap_factor) and self.dpp_cap_factor >= 1.0):
            p.append(f"--dpp-cap-factor={self.dpp_cap_factor} must be a finite number >= 1")
        elif self.dpp_cap_factor != 1.0 and self.dpp_max_inflight is not None:
            p.append(f"--dpp-cap-factor={self.dpp_cap_factor} and --dpp-max-inflight={self.dpp_max_inflight}: "
                     "give one (a fixed cap for every stage, or a multiple of each stage's 1F1B cap)")
        elif self.dpp_cap_factor != 1.0 and not (self.use_dpp and self.dpp_policy != "zb-h1"):
            p.append(f"--dpp-cap-factor={self.dpp_cap_factor} applies to --use-dpp with --dpp-policy dpp/dpp-zb")
        if self.dpp_max_inflight is not None and self.dpp_max_inflight < 1:
            p.append(f"--dpp-max-inflight={self.dpp_max_inflight} must be >= 1")
        if self.dpp_policy not in DPP_POLICIES:
            p.append(f"--dpp-policy={self.dpp_policy!r} must be one of {', '.join(DPP_POLICIES)}")
        elif self.dpp_policy == "dpp-zb" and not self.use_dpp:
            p.append("--dpp-policy=dpp-zb needs --use-dpp (without it the policy would be ignored)")
        if self.dpp_policy == "zb-h1" and self.dpp_max_inflight is not None:
            p.append(f"--dpp-max-inflight={self.dpp_max_inflight} applies to --dpp-policy dpp/dpp-zb, "
                     "not to the static zb-h1")
        return p

    def __post_init__(self) -> None:
        p = [f"--{n.replace('_', '-')}={getattr(self, n)} must be >= 1"
             for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
             if getattr(self, n) < 1]
        if self.num_layers_per_virtual_pipeline_stage is not None and self.num_layers_per_virtual_pipeline_stage < 1:
            p.append(f"--num-layers-per-virtual-pipeline-stage={self.num_layers_per_virtual_pipeline_stage}"
                     " must be >= 1")
        p.extend(self._dpp_problems())
        if self.transport not in TRANSPORTS:
            p.append(f"--transport={self.transport!r} must be one of {', '.join(TRANSPORTS)}")
        if self.distributed_backend not in ("auto", "nccl", "gloo"):
            p.append(f"--distributed-backend={self.distributed_backend!r} must be one of auto, nccl, gloo")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # Megatron-LM turns it off with a warning; refused here rather than ignored.
            p.append("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence over the "
                     "tensor-parallel ranks)")
        if self.dpp_timeout_s <= 0:
            p.append(f"--dpp-timeout={self.dpp_timeout_s} must be > 0")
        if self.overlap_param_gather:  # Megatron-LM's two assertions
            p.extend(f"--overlap-param-gather needs {flag}" for flag, on in
                     (("--use-distributed-optimizer", self.use_distributed_optimizer),
                      ("--overlap-grad-reduce", self.overlap_grad_reduce)) if not on)
        if self.cuda_graph_impl not in ("none", "local"):
            p.append(f"--cuda-graph-impl={self.cuda_graph_impl!r} must be none or local (megatron-core's own "
                     "graphs; transformer_engine needs Transformer Engine, full_iteration is not offered)")
        vs = self.num_virtual_stages_per_pipeline_rank
        if vs is not None and vs < 1:
            p.append(f"--num-virtual-stages-per-pipeline-rank={vs} must be >= 1")
        if vs is not None and self.num_layers_per_virtual_pipeline_stage is not None:
            p.append(f"--num-virtual-stages-per-pipeline-rank={vs} and --num-layers-per-virtual-pipeline-stage="
                     f"{self.num_layers_per_virtual_pipeline_stage} are mutually exclusive")
        uneven = self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None
        if uneven and self.num_layers_per_virtual_pipeline_stage is not None:
            # Megatron-LM's rule: layers per virtual stage differ between stages of an uneven split.
            p.append(f"--num-layers-per-virtual-pipeline-stage={self.num_layers_per_virtual_pipeline_stage} "
                     "cannot be used with --decoder-first/last-pipeline-num-layers; give "
                     "--num-virtual-stages-per-pipeline-rank instead")
        _check(p)


@dataclass(frozen=True)
class OptimConfig:
    """Batch sizes, optimizer and learning-rate schedule (Megatron-LM's names)."""

    micro_batch_size: int = 1
    """Samples per microbatch (``--micro-batch-size``)."""
    global_batch_size: int = 8
    """Samples per iteration over all DP replicas (``--global-batch-size``)."""
    train_iters: int | None = None
    """Iterations to train (``--train-iters``); None: --train-samples // --global-batch-size when
    --train-samples is given, else 10. Exclusive with --train-samples (Megatron-LM's rule)."""
    train_samples: int | None = None
    """Sample-based training (``--train-samples``), as Megatron-LM: train_samples // global_batch_size
    iterations (a partial last batch is dropped); the LR schedule is then given in samples."""
    lr: float = 1e-3
    """Peak learning rate (``--lr``)."""
    min_lr: float = 0.0
    """Floor of the decay (``--min-lr``)."""
    lr_warmup_iters: int = 0
    """Linear warm-up iterations (``--lr-warmup-iters``); iteration-based training only."""
    lr_warmup_samples: int = 0
    """Linear warm-up in samples (``--lr-warmup-samples``); with --train-samples only."""
    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of the decay length (``--lr-warmup-fraction``), in either mode; exclusive
    with --lr-warmup-iters / --lr-warmup-samples."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    """Decay after warm-up (``--lr-decay-style``)."""
    lr_decay_iters: int | None = None
    """Iterations over which to decay; None means the training length. Iteration-based only."""
    lr_decay_samples: int | None = None
    """Samples over which to decay (``--lr-decay-samples``); None means --train-samples. With
    --train-samples only."""
    weight_decay: float = 0.01
    """AdamW weight decay (``--weight-decay``)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables (``--clip-grad``)."""
    adam_beta1: float = 0.9
    """Adam beta1 (``--adam-beta1``)."""
    adam_beta2: float = 0.999
    """Adam beta2 (``--adam-beta2``)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """``--optimizer`` (Megatron-LM's): megatron-core's Adam(W) or SGD (momentum 0.9, Megatron's
    default), both with fp32 main weights under --bf16/--fp16."""
    seed: int = 1234
    """Seed for initialisation, dropout and mock data (``--seed``)."""
    bf16: bool = False
    """bfloat16 parameters and compute with fp32 main weights (``--bf16``)."""
    fp16: bool = False
    """float16 with dynamic loss scaling (``--fp16``)."""

    def __post_init__(self) -> None:
        p = [f"--{n.replace('_', '-')}={getattr(self, n)} must be >= 1"
             for n in ("micro_batch_size", "global_batch_size") if getattr(self, n) < 1]
        p.extend(self._schedule_problems())
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            p.append(f"--lr={self.lr} / --min-lr={self.min_lr} need 0 <= min-lr <= lr and lr > 0")
        if self.lr_decay_style not in DECAY_STYLES:
            p.append(f"--lr-decay-style={self.lr_decay_style!r} must be one of {', '.join(DECAY_STYLES)}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            p.append(f"--weight-decay={self.weight_decay} and --clip-grad={self.clip_grad} must be >= 0")
        if self.bf16 and self.fp16:
            p.append("--bf16 and --fp16 are mutually exclusive")
        if self.optimizer not in ("adam", "sgd"):
            p.append(f"--optimizer={self.optimizer!r} must be adam or sgd")
        _check(p)

    def _schedule_problems(self) -> list[str]:
        """Megatron-LM's rules for iteration- vs sample-based training (validate_args), plus the ranges
        and megatron-core's OptimizerParamScheduler assertion (warm-up shorter than decay) up front."""
        p = [f"--{n.replace('_', '-')}={getattr(self, n)} must be >= 1"
             for n in ("train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples")
             if getattr(self, n) is not None and getattr(self, n) < 1]
        p.extend(f"--{n.replace('_', '-')}={getattr(self, n)} must be >= 0"
                 for n in ("lr_warmup_iters", "lr_warmup_samples") if getattr(self, n) < 0)
        fraction = self.lr_warmup_fraction
        if fraction is not None and not 0.0 <= fraction < 1.0:
            p.append(f"--lr-warmup-fraction={fraction} must be in [0, 1)")
        if self.train_samples is not None:
            wrong = [(n, v) for n, v in (("train_iters", self.train_iters), ("lr_decay_iters", self.lr_decay_iters))
                     if v is not None] + ([("lr_warmup_iters", self.lr_warmup_iters)] if self.lr_warmup_iters else [])
            p.extend(f"--{n.replace('_', '-')}={v} is iteration-based but --train-samples={self.train_samples} "
                     "asks for sample-based training" for n, v in wrong)
            if fraction is not None and self.lr_warmup_samples:
                p.append(f"--lr-warmup-fraction={fraction} and --lr-warmup-samples={self.lr_warmup_samples}: "
                         "give only one")
            if self.global_batch_size >= 1 and 1 <= self.train_samples < self.global_batch_size:
                p.append(f"--train-samples={self.train_samples} is less than one iteration of "
                         f"--global-batch-size={self.global_batch_size}")
        else:
            p.extend(f"--{n.replace('_', '-')}={v} is sample-based: it needs --train-samples"
                     for n, v in (("lr_decay_samples", self.lr_decay_samples),
                                  ("lr_warmup_samples", self.lr_warmup_samples or None)) if v is not None)
            if fraction is not None and self.lr_warmup_iters:
                p.append(f"--lr-warmup-fraction={fraction} and --lr-warmup-iters={self.lr_warmup_iters}: "
                         "give only one")
        if not p and self.global_batch_size >= 1:
            warmup, decay, _ = self.lr_schedule_samples
            if warmup >= decay:
                p.append(f"LR warm-up of {warmup:g} samples is not shorter than the decay of {decay:g} samples "
                         "(--lr-warmup-* against --lr-decay-* or the training length)")
        return p

    @property
    def total_iters(self) -> int:
        """Iterations this run trains: --train-iters, else --train-samples // --global-batch-size
        (Megatron-LM's update_train_iters, no batch-size ramp-up), else 10."""
        if self.train_iters is not None:
            return self.train_iters
        if self.train_samples is not None:
            return self.train_samples // self.global_batch_size
        return DEFAULT_TRAIN_ITERS

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.total_iters

    @property
    def lr_schedule_samples(self) -> tuple[float, int, int]:
        """(warm-up, decay, weight-decay increment) lengths in samples, the units megatron-core's
        OptimizerParamScheduler steps in (by global batch size), computed as Megatron-LM's
        get_optimizer_param_scheduler does in both modes; a warm-up fraction is of the decay."""
        gbs = self.global_batch_size
        if self.train_samples is not None:
            decay, wd_incr = self.lr_decay_samples or self.train_samples, self.train_samples
            warmup: float = self.lr_warmup_samples
        else:
            decay, wd_incr = self.decay_iters * gbs, self.total_iters * gbs
            warmup = self.lr_warmup_iters * gbs
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return warmup, decay, wd_incr


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from: a preprocessed indexed dataset or seeded synthetic tokens."""

    data_path: tuple[str, ...] = ()
    """``--data-path PREFIX`` (a megatron-core indexed dataset, without .bin/.idx), or Megatron-LM's
    blend ``--data-path 0.3 A 0.7 B`` (weights normalised; several prefixes without weights blend by
    size): samples come from megatron-core's BlendedMegatronDatasetBuilder (trainer/data/megatron_datasets.py;
    GPTDataset, BERTMaskedWordPieceDataset). --variable-seq-lengths reads one prefix with the project's
    own datasets."""
    data_cache_path: str | None = None
    """Where megatron-core caches its dataset indices (GPT document/sample/shuffle, BERT samples, blends)
    (``--data-cache-path``, as Megatron-LM); None: a ``cache/`` folder beside the data, its default."""
    mock_data: bool = False
    """Synthetic tokens from a seeded generator, fetched by sample index (``--mock-data``)."""
    vocab_file: str | None = None
    """Tokenizer vocabulary (``--vocab-file``): GPT-2 vocab.json or BERT vocab.txt."""
    merge_file: str | None = None
    """GPT-2 BPE merges (``--merge-file``)."""
    tokenizer_type: TokenizerType = "GPT2BPETokenizer"
    """``--tokenizer-type`` (Megatron's names)."""
    tokenizer_model: str | None = None
    """``--tokenizer-model``: the SentencePiece model of Llama2Tokenizer (tokenizer.model), or the local
    folder (or tokenizer.json) of HuggingFaceTokenizer; read offline, nothing is downloaded."""
    variable_seq_lengths: bool = False
    """Megatron-LM's ``--variable-seq-lengths``: each microbatch is as long as its documents (GPT: one
    document or piece of one per sample; BERT: one sentence group), rounded up to
    --seq-length-divisible-by and capped at --seq-length, all samples of a microbatch padded to one
    length. Sets megatron-core's variable_seq_lengths (a shape exchange before each P2P transfer)
    and, for GPT, its calculate_per_token_loss (the loss is averaged over the global batch's tokens)."""
    seq_length_divisible_by: int = 64
    """With --variable-seq-lengths: round each microbatch's length up to a multiple of this
    (like --make-vocab-size-divisible-by), so there are few distinct shapes."""
    mock_seq_len_dist: str | None = None
    """With --mock-data --variable-seq-lengths: ``lognormal:SIGMA[:MEAN]``, mock document lengths =
    MEAN tokens (default --seq-length / 2) x a mean-one log-normal ratio (the simulator's
    --seq-len-dist), drawn per sample from (--seed, sample index); required in that mode."""

    split: str | None = None
    """Train/valid/test shares (``--split 969,30,1``, Megatron-LM's weights): of each prefix's documents
    for --data-path (megatron-core's builder, as Megatron-LM), else of sample indices in repeating
    blocks (trainer/data/split.py; mock data, --variable-seq-lengths). Training reads only the
    train share, --eval-interval the valid share. None: every sample trains, or Megatron-LM's default
    969,30,1 when validating."""

    def __post_init__(self) -> None:
        p = []
        if self.seq_length_divisible_by < 1:
            p.append(f"--seq-length-divisible-by={self.seq_length_divisible_by} must be >= 1")
        if self.mock_seq_len_dist is not None:
            p.extend(parse_length_distribution(self.mock_seq_len_dist)[1])
            if not (self.mock_data and self.variable_seq_lengths):
                p.append(f"--mock-seq-len-dist={self.mock_seq_len_dist} needs --mock-data and --variable-seq-lengths")
        elif self.mock_data and self.variable_seq_lengths:
            p.append("--variable-seq-lengths with --mock-data needs --mock-seq-len-dist (e.g. lognormal:0.6): "
                     "mock samples have no documents of their own")
        if isinstance(self.data_path, str):  # one prefix given as a string, not a list
            object.__setattr__(self, "data_path", (self.data_path,))
        object.__setattr__(self, "data_path", tuple(self.data_path))
        if not self.mock_data and not self.data_path:
            p.append("one of --data-path or --mock-data is required")
        if self.mock_data and self.data_path:
            p.append(f"--mock-data and --data-path {' '.join(self.data_path)} are mutually exclusive")
        blend, blend_problems = parse_blend(self.data_path)
        p.extend(blend_problems)
        if blend is not None and len(blend.prefixes) > 1 and self.variable_seq_lengths:
            p.append(f"--variable-seq-lengths reads one --data-path prefix (samples that carry their own length, "
                     f"which megatron-core's dataset builder does not offer), got {len(blend.prefixes)} to blend")
        if self.data_cache_path is not None and (self.mock_data or self.variable_seq_lengths):
            p.append(f"--data-cache-path={self.data_cache_path} caches megatron-core's dataset indices, which "
                     "--mock-data and --variable-seq-lengths do not build")
        if self.split is not None:
            p.extend(parse_split(self.split)[1])
        if self.tokenizer_type not in TOKENIZERS:
            p.append(f"--tokenizer-type={self.tokenizer_type!r} must be one of {', '.join(TOKENIZERS)}")
        if self.tokenizer_model is not None and self.tokenizer_type not in MODEL_FILE_TOKENIZERS:
            p.append(f"--tokenizer-model={self.tokenizer_model} is read by --tokenizer-type "
                     f"{' or '.join(MODEL_FILE_TOKENIZERS)}, not {self.tokenizer_type}")
        _check(p)

    def tokenizer_file_problems(self) -> list[str]:
        """The tokenizer files --data-path needs and lacks (a layout check: BERT's need of WordPiece
        is named first, by _bert_data_problems)."""
        if not self.data_path or self.tokenizer_type == "NullTokenizer":
            return []
        if self.tokenizer_type in MODEL_FILE_TOKENIZERS:
            return [] if self.tokenizer_model else [f"--tokenizer-model is required with --tokenizer-type="
                                                    f"{self.tokenizer_type}"]
        p = [] if self.vocab_file else [f"--vocab-file is required with --tokenizer-type={self.tokenizer_type}"]
        if self.tokenizer_type == "GPT2BPETokenizer" and not self.merge_file:
            p.append("--merge-file is required with --tokenizer-type=GPT2BPETokenizer")
        return p


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming (``--save``/``--load``/``--save-interval``)."""

    save: str | None = None
    """Directory to write checkpoints to."""
    load: str | None = None
    """Directory to resume from; an empty or missing one starts fresh."""
    save_interval: int | None = None
    """Save every N iterations (and at the end of training when --save is set)."""
    override_checkpoint_config: bool = False
    """Resume even when the checkpoint was saved with another seed, LR schedule, batch or model
    shape (by default that is refused, naming each difference)."""
    # ---- Megatron-LM's load and format flags (checked by _megatron_checkpoint_problems) ----
    ckpt_format: Literal["torch_dist"] = "torch_dist"
    """``--ckpt-format``: checkpoints are megatron-core's torch_dist format, Megatron-LM's default; the
    others (torch, zarr, fsdp_dtensor, torch_dcp) are refused."""
    exit_signal_handler: bool = False
    """``--exit-signal-handler``: accepted; saving a checkpoint and exiting on SIGTERM/SIGUSR1 is always on
    here (with --save)."""
    finetune: bool = False
    """``--finetune``: load only the model's weights from --load, start at iteration 0 with this run's
    optimizer, LR schedule and RNG (Megatron-LM's meaning); the model shape must still match."""
    no_load_optim: bool = False
    """``--no-load-optim``: do not load the optimizer and LR-scheduler state (the iteration still resumes)."""
    no_load_rng: bool = False
    """``--no-load-rng``: do not restore the random number generators' states."""
    override_opt_param_scheduler: bool = False
    """``--override-opt_param-scheduler``: the LR schedule (learning rates, warm-up, decay length and
    style, weight decay) comes from this command line, not the checkpoint; the step count is still
    loaded. So a run resumes with a longer --train-iters."""
    use_checkpoint_opt_param_scheduler: bool = False
    """``--use-checkpoint-opt_param-scheduler``: the LR schedule comes from the checkpoint, whatever this
    command line says."""
    exit_duration_in_mins: int | None = None
    """``--exit-duration-in-mins``: once the run has lasted this long (checked after every iteration,
    the longest-running rank deciding), save a checkpoint (with --save) and exit 0, as Megatron-LM."""

    def __post_init__(self) -> None:
        p = _megatron_checkpoint_problems(self)
        if self.save_interval is not None and self.save_interval < 1:
            p.append(f"--save-interval={self.save_interval} must be >= 1")
        _check(p)

    @property
    def loads_optimizer(self) -> bool:
        """Whether --load restores the optimizer and LR scheduler (not with --finetune / --no-load-optim)."""
        return not (self.finetune or self.no_load_optim)

    @property
    def loads_rng(self) -> bool:
        return not (self.finetune or self.no_load_rng)


def _megatron_checkpoint_problems(c: CheckpointConfig) -> list[str]:
    p = []
    if c.ckpt_format != "torch_dist":
        p.append(f"--ckpt-format={c.ckpt_format!r}: checkpoints here are megatron-core's torch_dist only "
                 "(Megatron-LM's default); torch (legacy), zarr, fsdp_dtensor and torch_dcp are not written or read")
    if c.exit_duration_in_mins is not None and c.exit_duration_in_mins < 1:
        p.append(f"--exit-duration-in-mins={c.exit_duration_in_mins} must be >= 1")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        p.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give one (the LR "
                 "schedule from this command line, or from the checkpoint)")
    return p


@dataclass(frozen=True)
class RunConfig:
    """Where and how this job runs; logging and profiling."""

    device: Literal["cuda", "cpu"] = "cuda"
    """``--device``: cuda (NCCL) or cpu (gloo, megatron-core with trainer.megatron_compat shims)."""
    run_name: str = "run"
    """Free-form run name (``--run-name``), used in logs, trace metadata and job ids."""
    workload: int | None = None
    """The prototype's ``--workload`` (an integer there too): how many elements of a stage-to-stage
    message one shared-memory copy handles (the prototype ran one copy thread per WORKLOAD elements,
    each through its own shared-memory segment). Here it sizes the shared-memory slots (CPU rings and
    same-node GPU slots) at N elements of the pipeline dtype: a larger message is cut into
    ceil(elements / N) slots, copied one after the other (this transport has no copy threads: one
    memcpy or one copy-engine transfer per slot). None: a slot holds one whole activation."""
    num_gpus: int | None = None
    """GPUs per node, the prototype's ``--num-gpus``: must match the ranks per node the launcher started
    (torchrun's LOCAL_WORLD_SIZE, srun's tasks per node) and --node-ips, and divide the world size; on
    CUDA the node must have that many GPUs. Without a launcher's node numbering, rank // N is the node
    and rank % N the GPU, as in the prototype."""
    multi_node: bool = False
    """The prototype's ``--multi-node``: the job spans nodes, so pipeline edges between nodes need a
    cross-node transport (nccl/gloo; --transport auto picks it per edge). Refused with --transport shm,
    or when what is known before start-up (--node-ips, --num-gpus, the launcher's ranks per node)
    puts every rank on one node; checked again once the ranks have reported their nodes."""
    node_ips: tuple[str, ...] = ()
    """``--node-ips a,b,...``: the prototype's one address per rank, in rank order (ranks sharing an
    address share a node), or one address per node in node order -- told apart by the count
    (trainer/node_addresses.py). The first is the rendezvous host when MASTER_ADDR is not set."""
    profile_dir: str | None = None
    """Write per-rank Chrome traces here (``--profile-dir``)."""
    log_interval: int = 1
    """Iterations between log lines (``--log-interval``)."""
    metrics_dir: str | None = None
    """Each rank writes ``metrics_rank<R>.json`` here at the end (``--metrics-dir``): per-iteration
    ms, losses, peak GPU memory, GPU busy time -- what the pipeline benchmark reads, not log text."""
    log_throughput: bool = False
    """Add Megatron-LM's ``throughput per GPU (TFLOP/s/GPU)`` to each iteration line
    (``--log-throughput``): its model-FLOPs count (trainer/flops.py) / (iteration time x world size)."""
    eval_interval: int | None = None
    """Every N iterations, run --eval-iters forward-only steps on the
    validation share of --split through the training schedule and print Megatron-LM's ``validation
    loss at iteration N`` line (``--eval-interval``). None: no validation (Megatron-LM's default is 1000)."""
    eval_iters: int = 100
    """Forward-only iterations (of --global-batch-size samples) per validation (``--eval-iters``)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard event files here (``--tensorboard-dir``, torch.utils.tensorboard; needs the
    tensorboard package): Megatron-LM's scalars ``lm loss``, ``learning-rate``, ``grad-norm``,
    ``loss-scale`` every iteration and ``lm loss validation`` at each validation, by the last
    stage's first rank."""
    gpu_busy_iters: int = 2
    """With --metrics-dir on CUDA: measure GPU busy time (kernel time on the GPU, torch.profiler)
    over the last N iterations, which the benchmark then leaves out of its timings; 0 = off."""
    inject_stalls: str | None = None
    """``RANK:FRACTION:MILLISECONDS[:SEED]``: delay that share of RANK's forward steps (the GPU stream
    on CUDA), the same ops under every schedule for one seed (trainer/stall_injection.py)."""
    manual_gc: bool = False
    """Megatron-LM's ``--manual-gc``: Python's automatic garbage collector is off for the run (one full
    collection when training starts) so that no rank pauses for it at a moment of its own; collections
    happen only where every rank is at the same point: around each evaluation (see
    --no-manual-gc-eval) and every --manual-gc-interval iterations."""
    manual_gc_interval: int = 0
    """With --manual-gc: a full collection after every N-th iteration, on all ranks (Megatron-LM's
    ``--manual-gc-interval``; 0, its default, never)."""
    manual_gc_eval: bool = True
    """With --manual-gc: a full collection before each evaluation and a young-generation one after it
    (Megatron-LM's default); ``--no-manual-gc-eval`` skips both."""
    cuda_sync_debug: Literal["warn", "error"] | None = None
    """Run every forward-backward step under ``torch.cuda.set_sync_debug_mode`` (``--cuda-sync-debug``):
    "error" makes any host synchronisation inside the step raise, the check that the pipeline never
    stalls the host."""

    def __post_init__(self) -> None:
        p = []
        if self.cuda_sync_debug not in (None, "warn", "error"):
            p.append(f"--cuda-sync-debug={self.cuda_sync_debug!r} must be warn or error")
        if self.device not in ("cuda", "cpu"):
            p.append(f"--device={self.device!r} must be cuda or cpu")
        if self.num_gpus is not None and self.num_gpus < 1:
            p.append(f"--num-gpus={self.num_gpus} must be >= 1")
        if self.workload is not None and self.workload < 1:
            p.append(f"--workload={self.workload} must be >= 1 (elements per shared-memory copy)")
        if self.log_interval < 1:
            p.append(f"--log-interval={self.log_interval} must be >= 1")
        if self.eval_interval is not None and self.eval_interval < 1:
            p.append(f"--eval-interval={self.eval_interval} must be >= 1")
        if self.eval_iters < 0:
            p.append(f"--eval-iters={self.eval_iters} must be >= 0")
        if self.gpu_busy_iters < 0:
            p.append(f"--gpu-busy-iters={self.gpu_busy_iters} must be >= 0")
        if self.manual_gc_interval < 0:
            p.append(f"--manual-gc-interval={self.manual_gc_interval} must be >= 0")
        elif not self.manual_gc:
            # Megatron-LM reads both only under --manual-gc; here they would be ignored, so refused.
            p.extend(f"{flag} needs --manual-gc (without it the automatic collector runs and it means nothing)"
                     for flag, given in ((f"--manual-gc-interval={self.manual_gc_interval}", self.manual_gc_interval),
                                         ("--no-manual-gc-eval", not self.manual_gc_eval)) if given)
        p.extend(stall_problems(self.inject_stalls))
        _check(p)


@dataclass(frozen=True)
class TrainConfig:
    """The whole configuration of one training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(mock_data=True))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # ---- derived sizes (valid once layout_problems() is empty) ---------------------------------
    def data_parallel(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    def num_microbatches(self, world_size: int) -> int:
        return self.optim.global_batch_size // (self.optim.micro_batch_size * self.data_parallel(world_size))

    @functools.cached_property
    def dpp_policy(self) -> str:
        """The DPP policy this run uses: ``--dpp-policy``, ``auto`` resolved (:func:`resolve_dpp_policy`).
        Resolved once per config (its checks look for installed packages); cached_property writes the
        instance's __dict__ directly, which a frozen dataclass allows, and ``dataclasses.replace``
        builds a new config that resolves afresh."""
        return resolve_dpp_policy(self)[0]

    @property
    def virtual_pipeline(self) -> int:
        """Model chunks per stage (v)."""
        if self.parallel.num_virtual_stages_per_pipeline_rank is not None:
            return self.parallel.num_virtual_stages_per_pipeline_rank
        per_stage = self.model.num_layers // self.parallel.pipeline_model_parallel_size
        vp_layers = self.parallel.num_layers_per_virtual_pipeline_stage
        return per_stage // vp_layers if vp_layers else 1

    @property
    def validates(self) -> bool:
        """--eval-interval with --eval-iters > 0: validation runs."""
        return self.run.eval_interval is not None and self.run.eval_iters > 0

    @property
    def sample_split(self) -> str | None:
        """The --split in force: as given, else Megatron-LM's default when validating, else None."""
        if self.data.split is not None:
            return self.data.split
        return MEGATRON_DEFAULT_SPLIT if self.validates else None

    @property
    def pipeline_itemsize(self) -> int:
        """Bytes per element of what the pipeline sends between stages (bf16/fp16: 2, else 4)."""
        return 2 if (self.optim.bf16 or self.optim.fp16) else 4

    @property
    def uneven_pipeline(self) -> bool:
        """--decoder-first/last-pipeline-num-layers given: megatron-core's uneven split."""
        par = self.parallel
        return par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None


def _stage_split_problems(cfg: TrainConfig) -> list[str]:
    """How the layers cannot be placed on the pipeline stages (and virtual stages)."""
    m, par = cfg.model, cfg.parallel
    pp, vp_layers = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    p: list[str] = []
    vs = par.num_virtual_stages_per_pipeline_rank
    if cfg.uneven_pipeline:
        p.extend(split_problems(m.num_layers, pp, vs or 1, par.decoder_first_pipeline_num_layers,
                                par.decoder_last_pipeline_num_layers))
    elif m.num_layers % pp:
        p.append(f"--num-layers={m.num_layers} is not divisible by --pipeline-model-parallel-size={pp}")
    elif vs is not None and vs > 1 and (pp == 1 or (m.num_layers // pp) % vs):
        p.append(f"--num-virtual-stages-per-pipeline-rank={vs} needs --pipeline-model-parallel-size > 1 "
                 f"and divides the {m.num_layers // pp} layers per stage")
    elif vp_layers is not None:
        if pp == 1:
            p.append(f"--num-layers-per-virtual-pipeline-stage={vp_layers} needs "
                     "--pipeline-model-parallel-size > 1")
        elif (m.num_layers // pp) % vp_layers:
            p.append(f"--num-layers={m.num_layers} / --pipeline-model-parallel-size={pp} = "
                     f"{m.num_layers // pp} layers per stage is not divisible by "
                     f"--num-layers-per-virtual-pipeline-stage={vp_layers}")
    return p


def _batch_problems(cfg: TrainConfig, dp: int) -> list[str]:
    """How the global batch cannot be cut into microbatches for ``dp`` data-parallel replicas."""
    o, par = cfg.optim, cfg.parallel
    pp = par.pipeline_model_parallel_size
    p: list[str] = []
    if o.global_batch_size % (o.micro_batch_size * dp):
        p.append(f"--global-batch-size={o.global_batch_size} is not divisible by "
                 f"--micro-batch-size={o.micro_batch_size} x data-parallel size {dp}")
    else:
        microbatches = o.global_batch_size // (o.micro_batch_size * dp)
        if pp > 1 and microbatches < pp:
            p.append(f"{microbatches} microbatches per iteration (--global-batch-size="
                     f"{o.global_batch_size} / (--micro-batch-size={o.micro_batch_size} x DP {dp})) "
                     f"is fewer than --pipeline-model-parallel-size={pp} stages")
        if cfg.virtual_pipeline > 1 and not par.use_dpp and cfg.run.device == "cuda" and microbatches % pp:
            p.append(f"megatron-core's interleaved 1F1B needs microbatches ({microbatches}) divisible "
                     f"by --pipeline-model-parallel-size={pp}; use --use-dpp or change the batch")
    return p


def layout_problems(cfg: TrainConfig, world_size: int, ranks_per_node: int | None = None) -> list[str]:
    """Every way ``cfg`` cannot be laid out on ``world_size`` ranks (empty list: it can);
    ``ranks_per_node``: what the launcher started on each node, where it says."""
    m, par = cfg.model, cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    p: list[str] = _node_problems(cfg, world_size, ranks_per_node)
    if world_size % (tp * pp):
        p.append(f"world size {world_size} is not divisible by --tensor-model-parallel-size={tp} x "
                 f"--pipeline-model-parallel-size={pp}")
    p.extend(_stage_split_problems(cfg))
    if m.num_attention_heads % tp:
        p.append(f"--num-attention-heads={m.num_attention_heads} is not divisible by "
                 f"--tensor-model-parallel-size={tp}")
    if m.ffn_size % tp:
        p.append(f"--ffn-hidden-size={m.ffn_size} is not divisible by --tensor-model-parallel-size={tp}")
    if world_size % (tp * pp) == 0:
        p.extend(_batch_problems(cfg, world_size // (tp * pp)))
    if cfg.virtual_pipeline > 1 and not par.overlap_p2p_comm and not par.use_dpp and pp == 2 \
            and cfg.run.device == "cuda":
        p.append("--no-overlap-p2p-communication with interleaving needs --pipeline-model-parallel-size > 2 "
                 "(Megatron-LM's rule: batched sends and receives between the same 2 ranks)")
    if par.sequence_parallel and tp > 1:
        p.extend(_sequence_parallel_problems(cfg))
    if cfg.validates and cfg.data.split is not None and parse_split(cfg.data.split)[0][1] == 0:
        p.append(f"--eval-interval={cfg.run.eval_interval} needs validation samples but --split="
                 f"{cfg.data.split} gives the valid share 0")
    p.extend(_split_backward_problems(cfg))
    if not cfg.parallel.dpp_fill_transit and not (cfg.parallel.use_dpp and cfg.dpp_policy == "dpp-zb"):
        p.append("--no-dpp-fill-transit applies to --use-dpp with dpp-zb (only it defers W); this run uses "
                 + resolve_dpp_policy(cfg)[1])
    p.extend(_variable_length_problems(cfg))
    p.extend(_bert_data_problems(cfg))
    p.extend(llama_layout_problems(cfg))
    p.extend(_cuda_graph_problems(cfg))
    p.extend(_recompute_slot_problems(cfg))
    p.extend(_megatron_graph_problems(cfg))
    p.extend(attention_backend_problems(cfg))
    if cfg.run.inject_stalls is not None and int(cfg.run.inject_stalls.split(":")[0]) >= world_size:
        p.append(f"--inject-stalls={cfg.run.inject_stalls!r} names rank {cfg.run.inject_stalls.split(':')[0]} "
                 f"but the world size is {world_size}")
    return p


def _node_problems(cfg: TrainConfig, world_size: int, ranks_per_node: int | None) -> list[str]:
    """The prototype's --num-gpus / --node-ips / --multi-node / --workload against each other and the
    launcher: every source of "ranks per node" known before start-up must agree."""
    run = cfg.run
    addresses, p = read_node_ips(run.node_ips, world_size)
    sources: dict[str, int] = {}  # what says how many ranks each node runs
    if ranks_per_node is not None:
        sources["the launcher"] = ranks_per_node
    if run.num_gpus is not None:
        if world_size % run.num_gpus:
            p.append(f"--num-gpus={run.num_gpus} (GPUs per node) does not divide the world size {world_size}")
        else:
            sources[f"--num-gpus={run.num_gpus}"] = run.num_gpus
    if addresses is not None:
        per_node = world_size // len(addresses.nodes)
        form = "per rank" if addresses.per_rank else "per node"
        sources[f"--node-ips ({len(addresses.nodes)} nodes, addresses {form})"] = per_node
    if len(set(sources.values())) > 1:
        p.append("ranks per node disagree: " + ", ".join(f"{who} says {n}" for who, n in sources.items())
                 + f" (world size {world_size})")
    elif run.multi_node and sources and world_size // next(iter(sources.values())) == 1:
        p.append(f"--multi-node but every rank is on one node ({', '.join(sources)}: {world_size} ranks per node)")
    if run.multi_node and cfg.parallel.transport == "shm":
        p.append("--multi-node with --transport shm: shared memory does not cross nodes; use --transport auto "
                 "(shm within a node, nccl/gloo between nodes), nccl or gloo")
    if run.workload is not None and run.workload * cfg.pipeline_itemsize < 4096:
        p.append(f"--workload={run.workload} elements x {cfg.pipeline_itemsize} bytes is below the 4096-byte "
                 f"shared-memory slot minimum (give at least {-(-4096 // cfg.pipeline_itemsize)})")
    return p


def _sequence_parallel_problems(cfg: TrainConfig) -> list[str]:
    """What rules out --sequence-parallel with TP > 1: BERT (not wired here), and sequence lengths it
    cannot split evenly over the TP ranks (megatron-core's scatter to the sequence-parallel region)."""
    tp, d = cfg.parallel.tensor_model_parallel_size, cfg.data
    p = []
    if cfg.model.model != "gpt":
        p.append("--sequence-parallel is implemented for --model gpt only (BERT's heads and pooler under sequence "
                 "parallelism are not wired or tested here)")
    if cfg.model.seq_length % tp:
        p.append(f"--sequence-parallel needs --seq-length={cfg.model.seq_length} divisible by "
                 f"--tensor-model-parallel-size={tp}")
    if d.variable_seq_lengths and d.seq_length_divisible_by % tp:
        p.append(f"--sequence-parallel with --variable-seq-lengths needs --seq-length-divisible-by="
                 f"{d.seq_length_divisible_by} divisible by --tensor-model-parallel-size={tp} (every "
                 "microbatch length must split evenly)")
    return p


MAX_GRAPHED_LENGTHS = 32
"""--dpp-cuda-graphs with --variable-seq-lengths: most bucket lengths captured per slot (capture time
and each length's static input/output buffers grow with the count; 16 at seq 1024 / 64)."""


def _cuda_graph_problems(cfg: TrainConfig) -> list[str]:
    """What rules out --dpp-cuda-graphs (trainer/pipeline/cuda_graphs.py says why each is needed)."""
    par, m = cfg.parallel, cfg.model
    if not par.dpp_cuda_graphs:
        return []
    why = {
        "--use-dpp (the graphs replace ops of the DPP runtime)": par.use_dpp,
        f"--dpp-policy dpp or dpp-zb (zb-h1's fixed order needs more slots than its cap; got {par.dpp_policy})":
            cfg.dpp_policy in ("dpp", "dpp-zb"),
        f"--device cuda (got {cfg.run.device})": cfg.run.device == "cuda",
        f"--model gpt (got {m.model})": m.model == "gpt",
        f"--tensor-model-parallel-size 1 (got {par.tensor_model_parallel_size})": par.tensor_model_parallel_size == 1,
        f"--hidden-dropout 0 --attention-dropout 0 (got {m.hidden_dropout}, {m.attention_dropout}): captured "
        "dropout would replay the same mask": m.hidden_dropout == 0 and m.attention_dropout == 0,
        "no --overlap-grad-reduce (a replayed backward runs no gradient hooks, which launch its reduction)":
            not par.overlap_grad_reduce,
        f"at most {MAX_GRAPHED_LENGTHS} sequence lengths to capture with --variable-seq-lengths (each slot holds a "
        f"graph pair per length; --seq-length {m.seq_length} / --seq-length-divisible-by "
        f"{cfg.data.seq_length_divisible_by} gives {-(-m.seq_length // cfg.data.seq_length_divisible_by)}: "
        "raise --seq-length-divisible-by)":
            not cfg.data.variable_seq_lengths
            or -(-m.seq_length // cfg.data.seq_length_divisible_by) <= MAX_GRAPHED_LENGTHS,
    }
    return [f"--dpp-cuda-graphs needs {need}" for need, ok in why.items() if not ok]


def _recompute_slot_problems(cfg: TrainConfig) -> list[str]:
    """--dpp-recompute-slots: per-slot selective recompute inside the DPP graphs."""
    par, given = cfg.parallel, cfg.parallel.dpp_recompute_slots
    if not given:
        return []
    flag = "--dpp-recompute-slots " + ",".join(map(str, given))
    p = []
    if not par.dpp_cuda_graphs:
        p.append(f"{flag} needs --dpp-cuda-graphs (it picks which graph slots recompute)")
    if any(n < 0 for n in given):
        p.append(f"{flag}: every count must be >= 0")
    if len(given) > par.pipeline_model_parallel_size:
        p.append(f"{flag} lists {len(given)} stages; --pipeline-model-parallel-size is "
                 f"{par.pipeline_model_parallel_size}")
    if cfg.model.recompute is not None:
        p.append(f"{flag} and --recompute-granularity {cfg.model.recompute} (or --recompute-activations): give "
                 "one (per-slot selective recompute, or recompute in every slot and eager op)")
    return p


def _megatron_graph_problems(cfg: TrainConfig) -> list[str]:
    """What rules out --cuda-graph-impl local (megatron-core's per-layer graphs for its schedules)."""
    par = cfg.parallel
    if par.cuda_graph_impl == "none":
        return []
    why = {
        "megatron-core's schedules (not --use-dpp: the DPP runtime's graphs are --dpp-cuda-graphs)":
            not par.use_dpp,
        f"--device cuda (got {cfg.run.device})": cfg.run.device == "cuda",
        "a fixed sequence length (not --variable-seq-lengths: graphs capture one shape)":
            not cfg.data.variable_seq_lengths,
        f"--cuda-graph-warmup-steps >= 0 (got {par.cuda_graph_warmup_steps})": par.cuda_graph_warmup_steps >= 0,
        # Measured on 4xH100 with megatron-core 0.19.2 (no Transformer Engine there): at PP=4 its graph
        # creation fails after the first step (assert fwd_buffer_reuse_ref_count == 0 in
        # _create_cudagraphs); PP=1 ran and matched eager. Refused until a pipeline run has passed.
        f"--pipeline-model-parallel-size 1 (got {par.pipeline_model_parallel_size}: megatron-core's "
        "local graphs failed to build under its pipeline schedule in the one configuration tried, "
        "docs/benchmarks.md)": par.pipeline_model_parallel_size == 1,
    }
    return [f"--cuda-graph-impl {par.cuda_graph_impl} needs {need}" for need, ok in why.items() if not ok]


def _bert_data_problems(cfg: TrainConfig) -> list[str]:
    """BERT on --data-path masks WordPiece tokens ([CLS]/[SEP]/[MASK], whole words): it needs a WordPiece
    --tokenizer-type (megatron-core's BERT dataset and the project's alike). That named, the tokenizer
    files --data-path needs (DataConfig.tokenizer_file_problems), so a BERT line without
    --tokenizer-type hears what it lacks rather than GPT-2's --merge-file."""
    d = cfg.data
    if cfg.model.model != "bert" or not d.data_path:
        return d.tokenizer_file_problems()
    if d.tokenizer_type.startswith("BertWordPiece"):
        return d.tokenizer_file_problems()
    default = " (the default)" if d.tokenizer_type == DataConfig.tokenizer_type else ""
    return [f"BERT needs a WordPiece tokenizer: --model bert with --data-path needs --tokenizer-type "
            f"BertWordPieceLowerCase or BertWordPieceCase and its --vocab-file (got {d.tokenizer_type}{default})"]


def _variable_length_problems(cfg: TrainConfig) -> list[str]:
    """What rules out --variable-seq-lengths with this model (fields are already valid)."""
    d, m = cfg.data, cfg.model
    if not d.variable_seq_lengths:
        return []
    p = []
    if d.seq_length_divisible_by > m.seq_length:
        p.append(f"--seq-length-divisible-by={d.seq_length_divisible_by} is larger than --seq-length="
                 f"{m.seq_length}: every microbatch would be --seq-length long")
    # No check against --max-position-embeddings is needed: lengths are capped at --seq-length, which
    # ModelConfig already keeps within the table. Nor for TP: megatron needs lengths divisible by TP
    # only with sequence parallelism (_sequence_parallel_problems).
    if d.mock_seq_len_dist is not None and m.model == "bert" and m.seq_length < 5:
        p.append(f"--mock-seq-len-dist with --model bert needs --seq-length >= 5 ([CLS] a [SEP] b [SEP]), "
                 f"got {m.seq_length}")
    return p


def resolve_dpp_policy(cfg: TrainConfig) -> tuple[str, str]:
    """(the policy --dpp-policy names, why) -- ``auto`` resolved: dpp-zb with --dpp-cuda-graphs where
    split backward is possible, else dpp. Why: on the issue-12 model (4xH100, eleventh session, same
    call, equal peak memory) graphed dpp-zb ran 474.6 ms per iteration against dpp's 493.2 (510.9 vs
    519.0 with two recomputing slots), once it waits for a gradient's data rather than its header
    (fill_transit); eager it did not win (973.1 vs 953.6 at v=1, within noise), so eager runs keep dpp."""
    par = cfg.parallel
    if par.dpp_policy != "auto":
        return par.dpp_policy, "--dpp-policy " + par.dpp_policy
    if not par.use_dpp:
        return "dpp", "--dpp-policy auto without --use-dpp (not used)"
    if not par.dpp_cuda_graphs:
        return "dpp", "--dpp-policy auto: without --dpp-cuda-graphs dpp-zb was not measured faster"
    blockers = _split_backward_problems(cfg, "dpp-zb")
    if blockers:
        return "dpp", "--dpp-policy auto: dpp-zb's split backward is ruled out: " + "; ".join(blockers)
    return "dpp-zb", "--dpp-policy auto: with --dpp-cuda-graphs dpp-zb is the faster at equal memory"


def _split_backward_problems(cfg: TrainConfig, policy: str | None = None) -> list[str]:
    """What rules out --dpp-policy dpp-zb / zb-h1 (split backward), knowable before any process group.
    ``policy``: the one to check (default: the run's, ``auto`` resolved)."""
    par, impl = cfg.parallel, cfg.model.transformer_impl
    if policy is None:
        policy = cfg.dpp_policy
    if policy not in ("dpp-zb", "zb-h1"):
        return []
    p = []
    # trainer.pipeline.split_backward defers the weight GEMMs of megatron's local linears only;
    # "auto" picks Transformer Engine on CUDA where it is installed (trainer.model.build), so only
    # there must the choice be explicit.
    if uses_transformer_engine_spec(cfg, _installed("transformer_engine")):
        backend = cfg.model.attention
        why = f"--attention-backend={backend}" if backend in TE_ATTENTION_BACKENDS else f"--transformer-impl={impl}"
        p.append(f"--dpp-policy={policy} splits the backward of megatron-core's local linear layers only: "
                 f"pass --transformer-impl local (got {why})")
    if par.sequence_parallel:
        p.append(f"--dpp-policy={policy} with --sequence-parallel: split backward defers the weight GEMMs of "
                 "linears without sequence parallelism only; drop one of them")
    if par.overlap_grad_reduce:
        p.append(f"--dpp-policy={policy} with --overlap-grad-reduce: the reduction would start from the gradient "
                 "hooks of I, before W has accumulated the weight gradients; drop --overlap-grad-reduce")
    if policy == "zb-h1" and cfg.virtual_pipeline > 1:
        p.append(f"--dpp-policy=zb-h1 needs one model chunk per stage, got {cfg.virtual_pipeline}")
    if policy == "zb-h1" and not par.use_dpp and cfg.run.device == "cuda" and par.distributed_backend != "gloo":
        p.append("--dpp-policy=zb-h1 without --use-dpp on CUDA: megatron-core's own schedule would run; "
                 "add --use-dpp")
    return p


TE_ATTENTION_BACKENDS = ("flash", "fused", "unfused")  # kernels of Transformer Engine's attention


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def uses_transformer_engine_spec(cfg: TrainConfig, te_installed: bool) -> bool:
    """Whether the model is built from megatron-core's Transformer Engine layer spec: a TE attention
    backend needs it, --attention-backend local is the local spec (Megatron-LM's --spec local), and
    otherwise --transformer-impl decides ("auto": TE on CUDA where it is installed)."""
    backend, impl = cfg.model.attention, cfg.model.transformer_impl
    if backend in TE_ATTENTION_BACKENDS:
        return True
    if backend == "local" or impl == "local":
        return False
    return impl == "transformer_engine" or (cfg.run.device == "cuda" and te_installed)


def attention_backend_problems(cfg: TrainConfig, environ: dict[str, str] | None = None) -> list[str]:
    """What rules out the --attention-backend / --use-flash-attn chosen, before any process starts:
    a contradicting --transformer-impl, a TE kernel on CPU or without Transformer Engine (or, for
    flash, without the flash-attn package), and NVTE_*_ATTN variables that megatron-core would find
    set against the backend (it asserts on them when building the model, even for auto)."""
    import os

    backend, impl = cfg.model.attention, cfg.model.transformer_impl
    flag = ("--use-flash-attn" if cfg.model.use_flash_attn else
            f"--attention-backend {backend}" + (" (the default)" if backend == "auto" else ""))
    p = []
    if backend == "local" and impl == "transformer_engine":
        p.append(f"{flag} is megatron-core's own attention (the local layer spec) but --transformer-impl "
                 "transformer_engine asks for Transformer Engine's: give one of them")
    if backend in TE_ATTENTION_BACKENDS:
        if impl == "local":
            p.append(f"{flag} is a kernel of Transformer Engine's attention but --transformer-impl local builds "
                     "megatron-core's own: drop one of them (--attention-backend local is the local one)")
        if cfg.run.device != "cuda":
            p.append(f"{flag} needs --device cuda (Transformer Engine's attention kernels are CUDA only); "
                     "on CPU use --attention-backend auto or local")
        elif not _installed("transformer_engine"):
            p.append(f"{flag} needs Transformer Engine, which is not installed (transformer_engine does not "
                     "import here); install it, or use --attention-backend auto or local")
        if backend == "flash" and cfg.run.device == "cuda" and not any(
                _installed(m) for m in ("flash_attn", "flash_attn_interface", "flash_attn_3")):
            p.append(f"{flag} needs the flash-attn package (Transformer Engine's flash backend calls it), which "
                     "is not installed; install flash-attn, or use --attention-backend fused/unfused/auto")
    if impl == "transformer_engine" and backend not in (*TE_ATTENTION_BACKENDS, "local"):
        # The TE backends and --attention-backend local name their own problem above; otherwise the
        # model build would fail after start-up with an import traceback.
        if cfg.run.device != "cuda":
            p.append("--transformer-impl transformer_engine needs --device cuda (Transformer Engine's layers are "
                     "CUDA only); on CPU use --transformer-impl local or auto")
        elif not _installed("transformer_engine"):
            p.append("--transformer-impl transformer_engine needs Transformer Engine, which is not installed "
                     "(transformer_engine does not import here); install it, or use --transformer-impl local or auto")
    env = os.environ if environ is None else environ
    for name, want in zip(NVTE_ATTENTION_ENV, NVTE_ATTENTION_VALUES[backend], strict=True):
        if env.get(name) not in (None, str(want)):
            p.append(f"{flag} sets {name}={want} but the environment has {name}={env[name]} "
                     "(megatron-core refuses the mismatch): unset it")
    return p


# ---- command line ------------------------------------------------------------------------------
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
    for section in (ModelConfig, ParallelConfig, OptimConfig, DataConfig, CheckpointConfig, RunConfig):
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
            elif f.name == "dpp_recompute_slots":
                group.add_argument(flag, type=_int_list, metavar="N[,N...]", **kwargs)
            elif f.name == "node_ips":
                group.add_argument(flag, type=lambda s: tuple(x for x in s.split(",") if x), metavar="IP,IP,...",
                                   **kwargs)
            else:
                group.add_argument(flag, type=_parse_type(f.type), metavar=f.name.upper(), **kwargs)
    return parser


def _int_list(text: str) -> tuple[int, ...]:
    """``1,0,2`` -> (1, 0, 2); argparse turns the ValueError into an error naming the value."""
    return tuple(int(x) for x in text.split(","))


_int_list.__name__ = "comma-separated integer list"  # argparse names the type in its error


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
    for section in (ModelConfig, ParallelConfig, OptimConfig, DataConfig, CheckpointConfig, RunConfig):
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
