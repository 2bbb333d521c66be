"""The configuration's sections as typed frozen dataclasses, Megatron-LM's flag names (docs/training.md#flags).

Each section validates its own fields in ``__post_init__`` (one :class:`ConfigError` naming every bad
value); what needs several sections or the world size is :mod:`trainer.config.layout`'s, and which
schedule runs is :mod:`trainer.config.plan`'s. A field's docstring is its ``--help`` text, its type
hint its choices (trainer/config/parser.py reads both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from trainer.names import TRANSPORTS, Transport

DPP_POLICIES = ("auto", "dpp", "dpp-zb", "zb-h1", "1f1b", "interleaved")
STATIC_DPP_POLICIES = ("zb-h1", "1f1b", "interleaved")
"""Fixed orders the DPP runtime replays as written (trainer/schedule/static.py): the bars the dynamic
policies are measured against in the same runtime, with or without --dpp-cuda-graphs."""
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")  # megatron-core's AttnBackend names


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
    te_rng_tracker: bool = False
    """Transformer Engine's RNG tracker instead of megatron-core's (Megatron-LM's ``--te-rng-tracker``):
    dropout masks from TE's graph-safe generator states. Needs Transformer Engine on CUDA. Turned on by
    itself, as in Megatron-LM, where megatron-core's graphs (--cuda-graph-impl local) capture TE's
    layers: TE's attention refuses any other tracker under their capture."""
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
        p.extend(llama_problems(self))
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


def llama_problems(m: ModelConfig) -> list[str]:
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
    dpp_held_cap: Literal["auto", "stage", "peak", "fit"] = "auto"
    """Which 1F1B bound caps a stage's *held* activations under the dynamic policies
    (``--dpp-held-cap``; --dpp-cap-factor multiplies it): ``stage`` = the stage's own (p - s at PP=p), as
    1F1B holds; ``peak`` = stage 0's (p) on every stage, ZB-H1's memory, which lets later stages defer
    their W's; ``fit`` (CUDA graphs, one chunk per stage) = each stage's own bound, then more slots up to
    ``peak`` while the stage's measured memory stays within the job's largest rank at the stages' own
    bounds (trainer/pipeline/stage_graphs.py); ``auto`` = ``stage`` for dpp, ``fit`` for graphed dpp-zb,
    ``peak`` for eager dpp-zb. ``peak`` assumes every stage's microbatch costs stage 0's memory; where a
    later stage's costs more (BERT: the last stage's slots, 4 at PP=4, made it the largest rank, 1.30x
    megatron-core's memory), ``fit`` and ``stage`` keep the job at what 1F1B's bounds need."""
    dpp_chunk_caps: Literal["auto", "interleaved", "none"] = "auto"
    """With two or more chunks per stage, whether the dynamic policies also cap each chunk's held
    activations (``--dpp-chunk-caps``): ``interleaved`` = at what megatron-core's interleaved order holds
    in that chunk (on the stage --dpp-held-cap's bound comes from; 8/4 on stage 0 at PP=4, M=32), so the
    CUDA graphs capture the interleaved order's slots per chunk; ``none`` = only the stage's cap, so a
    forward may take any chunk's slot and each chunk captures the whole cap (11 per chunk there: about
    1.8x the interleaved order's slot memory); ``auto`` = ``interleaved`` with CUDA graphs, ``none``
    eager (eager memory is what is held, bounded by the stage's cap already)."""
    dpp_max_queued_ops: int | None = None
    """How many of its queued ops a DPP stage's host may have unfinished on the GPU before it decides
    the next (``--dpp-max-queued-ops``; trainer/pipeline/run_ahead.py): decisions near GPU time
    instead of at host time, so a forward whose input is still being computed upstream does not
    hold back a ready backward on the stream. 0 = unbounded. Default: 1 with CUDA graphs (on
    4xH100, the benchmark model: 482 ms/iteration at 1, 524 at 2, 559 unbounded; docs/benchmarks.md), 0
    otherwise (eager DPP not measured with it). CUDA only in effect."""
    dpp_fill_transit: bool = True
    """dpp-zb: while every ready input gradient is still on its way to this GPU (its header comes
    when the neighbour *queued* the op making it), run a deferred W meanwhile, and a landed gradient's
    I before a travelling one's; at v > 1 likewise a landed forward, I or W before a forward whose
    activation is still on its way (``--no-dpp-fill-transit``: decide on headers alone, the earlier
    behaviour; for measurements). trainer/schedule/dynamic.py, DynamicOptions.fill_transit and
    land_forwards."""
    dpp_land_forwards: bool = True
    """dpp-zb with two or more chunks per stage: a forward whose activation is still on its way to this
    GPU waits behind a landed forward, I or W (``--no-dpp-land-forwards``: queue it on its header, the
    earlier behaviour, which the host-time model puts 29% behind at PP=4; for measurements).
    trainer/schedule/dynamic.py, DynamicOptions.land_forwards."""
    dpp_weight_order: Literal["auto", "oldest", "youngest"] = "auto"
    """dpp-zb: which deferred W fills idle time first. ``auto``: youngest at one chunk per stage; at two or more,
    youngest under the CUDA graph slots unless ``--dpp-graph-operand-copies in-i`` (where W's operands are
    copied lazily, a W right after its own I needs no copy; the host-time model puts the two orders within 0.9% of each other
    there, while at PP=4 oldest first leaves 113 of the 256 W's of an iteration to an evacuation and youngest
    first 47), oldest otherwise (measured, not derived: docs/schedules.md). trainer/schedule/dynamic.py,
    DynamicOptions.weight_order."""
    dpp_graph_operand_copies: Literal["auto", "lazy", "in-i"] = "auto"
    """Split backward under CUDA graphs: what a slot's W reads that its I allocated in the stage's shared
    backward pool. ``auto`` (default) and ``lazy``: left there, and copied into a buffer set (see
    --dpp-graph-evacuation-sets) only when another backward graph of the stage replays before that W (a W
    right after its I reads it in place), for megatron-core's local linears and Transformer Engine's alike;
    ``in-i``: copied inside every I into the slot's own buffers, the earlier behaviour (for measurements). trainer/pipeline/graph_operands.py."""
    dpp_graph_evacuation_sets: str = "auto"
    """Split backward under CUDA graphs with W's operands left in the backward pool: how many buffer sets a
    stage's slots share for the operands they copy out of it when another backward comes first (a slot
    finding none free runs its W at once, before the backward that needed the pool). ``auto`` (default): at
    two or more chunks per stage as many as pipeline stages, within -1.0 .. +0.2% of a set per slot in the
    host-time model with the pool priced (3-6 of the last stage's 64 W's per iteration run early at PP=4,
    v=2); for dpp-zb at one chunk two (at most the pipeline size), within 0.1% of a set per slot there,
    and the memory the other sets would take goes to the held-cap fit's extra slots on the later stages
    (BERT at PP=4: stage 3 kept 1 slot with 4 sets); ZB-H1 p at any chunk count (its order holds every W
    behind later I's, and the model put it 5% slower with 2 sets at PP=4); never more than the slots the stage may hold
    (docs/schedules.md); a number N >= 1: N sets; ``slots``: a set per slot, the earlier layout (its
    memory grows with the slots: 1.82 GiB of 17.42 on stage 0 at PP=4, v=2). Gradients are equal whatever
    the count. trainer/pipeline/graph_operands.py."""
    dpp_sp_wgrad_input: Literal["keep", "regather"] = "keep"
    """Split backward (dpp-zb, zb-h1) with --sequence-parallel: a column-parallel linear's deferred
    weight GEMM needs its input gathered over TP. ``keep`` (default) keeps the gathered input from the
    forward until W (TP x the local input's memory per such linear; W is a local GEMM); ``regather``
    keeps the local 1/TP and all-gathers it again in W, as megatron's backward does (megatron's memory,
    a TP all-gather per linear in every W). trainer/pipeline/split_backward.py."""
    dpp_policy: Literal["auto", "dpp", "dpp-zb", "zb-h1", "1f1b", "interleaved"] = "auto"
    """Policy of the DPP runtime (``--dpp-policy``): dpp (greedy), dpp-zb (greedy with split backward:
    deferred weight gradients fill idle time), zb-h1 (static zero-bubble schedule; also selects it for
    the runtime's non-DPP CPU path), 1f1b / interleaved (megatron-core's orders, v = 1 / v >= 2, replayed
    as written by the runtime: with --dpp-cuda-graphs the graphed static bars the dynamic policies are
    measured against), auto (the default: dpp-zb with CUDA graphs where its split backward is
    possible, else dpp -- what measured fastest at equal memory, docs/schedules.md; the log's layout
    line says which ran and why: trainer/config/plan.py). With Transformer Engine's layers the split
    backward runs TE's own deferred weight GEMMs (docs/transformer_engine.md)."""
    dpp_cuda_graphs: bool = False
    """Ask for CUDA graphs: a layout they cannot run is an error (``--use-dpp`` alone turns them on
    where they can run and stays eager, saying why, where they cannot; ``--dpp-eager`` turns them off).
    Replay the forward and backward of every chunk's transformer block from CUDA graphs, one graph
    pair per in-flight activation slot (``--dpp-cuda-graphs``; trainer/pipeline/cuda_graphs.py): removes
    the launch overhead that makes small-microbatch forwards host-bound. GPT or BERT on CUDA with --use-dpp
    --dpp-policy dpp or dpp-zb (F, I and W graphs per slot) or a static order (1f1b, interleaved, zb-h1:
    as many slots per chunk as the order holds at most); TP > 1 (with or without --sequence-parallel)
    captures the TP collectives and needs NCCL; dropout draws fresh masks every replay (not with
    recompute); costs GPU memory per slot."""
    dpp_eager: bool = False
    """Run the DPP runtime eagerly, without CUDA graphs (``--dpp-eager``). ``--use-dpp`` alone replays
    the transformer blocks from CUDA graphs wherever the layout allows them (on 4xH200, PP=4: 415.6 ms
    per iteration graphed against 814.6 for megatron-core's eager 1F1B; eager DPP runs at about
    megatron's speed) and runs eagerly, saying why, where it does not. Use it to save the graphs' GPU
    memory (a graph pair per activation slot) or their capture time, to debug or profile op by op, or as
    the eager bar in a measurement. Exclusive with --dpp-cuda-graphs."""
    dpp_recompute_slots: tuple[int, ...] = ()
    """With CUDA graphs (--use-dpp's default, or --dpp-cuda-graphs): how many of a stage's graph slots (of each chunk's, at v > 1) recompute
    the core attention in their backward graph (selective recompute, per slot), listed per stage from
    stage 0, comma-separated;
    stages not listed: none (``--dpp-recompute-slots 1`` = one slot of stage 0's). A recomputing slot
    holds ~55% of a slot's activations on the benchmark model for a share of the recompute's GPU time, so
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
    pipeline_stage_layers: tuple[float, ...] = ()
    """Transformer layers on each pipeline stage, from stage 0, comma-separated (e.g. 4.5,4,4,3.5):
    any count per stage, where --decoder-first/last-pipeline-num-layers set only the first and last,
    and half layers: x.5 ends a stage after the attention of its last layer, and the next stage
    starts with that layer's MLP. Balances a pipeline whole layers cannot (docs/schedules.md). Both
    megatron-core's schedules and --use-dpp build these stages; checkpoints keep megatron's layer keys,
    so a run may resume under another split. With --num-virtual-stages-per-pipeline-rank V: one count
    per virtual stage, chunk 0 of every stage first (megatron-core's order). Exclusive with
    --decoder-first/last-pipeline-num-layers."""
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
    step but asynchronously before the next forward: under megatron-core's schedules bucket by bucket
    from forward pre-hooks when the next forward first uses them (each bucket's wait dispatches the
    next); under the pipeline runtime all started right after the optimizer step and waited for before
    each chunk's first forward (trainer/pipeline/param_gather.py). A checkpoint save gathers them all
    first. Needs --use-distributed-optimizer and --overlap-grad-reduce, as in Megatron-LM."""
    batch_p2p_sync: bool = True
    """megatron-core syncs the device after each batched P2P (batch_isend_irecv), a workaround for old
    PyTorch; --no-batch-p2p-sync turns it off (Megatron-LM has no flag; the name follows its
    --no-<field> convention for TransformerConfig.batch_p2p_sync). Only megatron-core's schedules use it."""

    def _cap_problems(self) -> list[str]:
        """The dynamic policies' caps: --dpp-cap-factor, --dpp-held-cap, --dpp-max-inflight, --dpp-chunk-caps."""
        p: list[str] = []
        if not (math.isfinite(self.dpp_cap_factor) and self.dpp_cap_factor >= 1.0):
            p.append(f"--dpp-cap-factor={self.dpp_cap_factor} must be a finite number >= 1")
        elif self.dpp_cap_factor != 1.0 and self.dpp_max_inflight is not None:
            p.append(f"--dpp-cap-factor={self.dpp_cap_factor} and --dpp-max-inflight={self.dpp_max_inflight}: "
                     "give one (a fixed cap for every stage, or a multiple of each stage's 1F1B cap)")
        elif self.dpp_cap_factor != 1.0 and not (self.use_dpp and self.dpp_policy not in STATIC_DPP_POLICIES):
            p.append(f"--dpp-cap-factor={self.dpp_cap_factor} applies to --use-dpp with --dpp-policy dpp/dpp-zb")
        if self.dpp_held_cap not in ("auto", "stage", "peak", "fit"):
            p.append(f"--dpp-held-cap={self.dpp_held_cap!r} must be one of auto, stage, peak, fit")
        elif self.dpp_held_cap != "auto" and self.dpp_max_inflight is not None:
            p.append(f"--dpp-held-cap={self.dpp_held_cap} and --dpp-max-inflight={self.dpp_max_inflight}: give one "
                     "(which 1F1B bound caps each stage, or a fixed cap for every stage)")
        elif self.dpp_held_cap != "auto" and not (self.use_dpp and self.dpp_policy not in STATIC_DPP_POLICIES):
            p.append(f"--dpp-held-cap={self.dpp_held_cap} applies to --use-dpp with --dpp-policy dpp/dpp-zb")
        if self.dpp_max_inflight is not None and self.dpp_max_inflight < 1:
            p.append(f"--dpp-max-inflight={self.dpp_max_inflight} must be >= 1")
        if self.dpp_chunk_caps not in ("auto", "interleaved", "none"):
            p.append(f"--dpp-chunk-caps={self.dpp_chunk_caps!r} must be one of auto, interleaved, none")
        elif self.dpp_chunk_caps != "auto" and not (self.use_dpp and self.dpp_policy not in STATIC_DPP_POLICIES):
            p.append(f"--dpp-chunk-caps={self.dpp_chunk_caps} applies to --use-dpp with --dpp-policy dpp/dpp-zb")
        return p

    def _dpp_problems(self) -> list[str]:
        """The DPP runtime's own knobs: policy, caps."""
        p: list[str] = []
        if self.dpp_max_queued_ops is not None and self.dpp_max_queued_ops < 0:
            p.append(f"--dpp-max-queued-ops={self.dpp_max_queued_ops} must be >= 0")
        elif self.dpp_max_queued_ops and not self.use_dpp:
            p.append(f"--dpp-max-queued-ops={self.dpp_max_queued_ops} applies to --use-dpp")
        p += self._cap_problems()
        if self.dpp_policy not in DPP_POLICIES:
            p.append(f"--dpp-policy={self.dpp_policy!r} must be one of {', '.join(DPP_POLICIES)}")
        elif self.dpp_policy == "dpp-zb" and not self.use_dpp:
            p.append("--dpp-policy=dpp-zb needs --use-dpp (without it the policy would be ignored)")
        if self.dpp_weight_order not in ("auto", "oldest", "youngest"):
            p.append(f"--dpp-weight-order={self.dpp_weight_order!r} must be one of auto, oldest, youngest")
        if self.dpp_graph_operand_copies not in ("auto", "lazy", "in-i"):
            p.append(f"--dpp-graph-operand-copies={self.dpp_graph_operand_copies!r} must be one of auto, lazy, in-i")
        sets = self.dpp_graph_evacuation_sets
        if sets not in ("auto", "slots") and not (sets.isdigit() and int(sets) >= 1):
            p.append(f"--dpp-graph-evacuation-sets={sets!r} must be auto, slots or a number >= 1")
        if self.dpp_sp_wgrad_input not in ("keep", "regather"):
            p.append(f"--dpp-sp-wgrad-input={self.dpp_sp_wgrad_input!r} must be one of keep, regather")
        if self.dpp_policy in STATIC_DPP_POLICIES and self.dpp_max_inflight is not None:
            p.append(f"--dpp-max-inflight={self.dpp_max_inflight} applies to --dpp-policy dpp/dpp-zb, "
                     f"not to the static {self.dpp_policy}")
        if self.dpp_eager and self.dpp_cuda_graphs:
            p.append("--dpp-cuda-graphs and --dpp-eager: give one (graphs are --use-dpp's default where they "
                     "can run; --dpp-eager turns them off)")
        elif self.dpp_eager and not self.use_dpp:
            p.append("--dpp-eager applies to --use-dpp (the DPP runtime's CUDA graphs)")
        if self.dpp_policy in ("1f1b", "interleaved") and not self.use_dpp:
            p.append(f"--dpp-policy={self.dpp_policy} needs --use-dpp (without it megatron-core's own "
                     "schedule runs, or on CPU the runtime's static order for the layout)")
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
        if self.pipeline_stage_layers and self.num_layers_per_virtual_pipeline_stage is not None:
            p.append(f"--pipeline-stage-layers and --num-layers-per-virtual-pipeline-stage="
                     f"{self.num_layers_per_virtual_pipeline_stage}: the first gives every virtual stage's layers; "
                     "ask for the chunks with --num-virtual-stages-per-pipeline-rank")
        if self.pipeline_stage_layers and uneven:
            p.append("--pipeline-stage-layers and --decoder-first/last-pipeline-num-layers: give one (the first "
                     "places every stage, the others the first and last)")
        if uneven and self.num_layers_per_virtual_pipeline_stage is not None:
            # Megatron-LM's rule: layers per virtual stage differ between stages of an uneven split.
            p.append(f"--num-layers-per-virtual-pipeline-stage={self.num_layers_per_virtual_pipeline_stage} "
                     "cannot be used with --decoder-first/last-pipeline-num-layers; give "
                     "--num-virtual-stages-per-pipeline-rank instead")
        _check(p)
