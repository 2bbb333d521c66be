"""What the pipeline benchmark runs: one configuration, the lines (schedules) and scenarios over it.

Every line is a separate run with the same model, data, optimizer, precision and iterations; all but
``megatron-1f1b-default`` use the same balanced layer split (:func:`balanced_split`). On CPU the
trainer runs jobs without --use-dpp on our runtime's static ``1f1b`` / ``interleaved`` policies
(trainer.config.plan.uses_megatron_schedule says why), so those run for the "megatron" lines: they are labelled so, and the
direct-megatron line is listed as not run, with the reason.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from trainer.bench.layouts import Layout
from trainer.problems import raise_if_any
from trainer.schedule import layers

CATALOGUE = {
    # name: (what it is, v, extra trainer flags, uses the balanced split)
    "megatron-1f1b-default": ("megatron-core 1F1B, even split, default P2P (batch_p2p_sync on)", 1, [], False),
    "megatron-1f1b-best": ("megatron-core 1F1B, balanced split, --no-batch-p2p-sync", 1, ["--no-batch-p2p-sync"], True),
    "megatron-1f1b-graphs": ("megatron-core 1F1B, balanced split, --no-batch-p2p-sync, --cuda-graph-impl local "
                             "(megatron-core's per-layer CUDA graphs, recorded in step 1: capture stays out of the timed window)", 1,
                             ["--no-batch-p2p-sync", "--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "1"], True),
    "megatron-1f1b-best-rc": ("megatron-core 1F1B, balanced split, --no-batch-p2p-sync, --recompute-activations "
                              "(what the same recompute costs and saves megatron: a reference, not its best)", 1,
                              ["--no-batch-p2p-sync", "--recompute-activations"], True),
    "megatron-interleaved-v2": ("megatron-core interleaved 1F1B v=2, overlapped P2P, balanced split", 2,
                                ["--no-batch-p2p-sync"], True),
    # The eager DPP lines say --dpp-eager: --use-dpp alone replays from CUDA graphs where they can run.
    "dpp": ("--use-dpp --dpp-eager --dpp-policy dpp (greedy, eager)", 1,
            ["--use-dpp", "--dpp-eager", "--dpp-policy", "dpp"], True),
    "dpp-default": ("--use-dpp alone: the runtime, graphs and policy --use-dpp picks for the layout (CUDA graphs "
                    "and dpp-zb where they can run; its log's first line says which and why)", 1, ["--use-dpp"], True),
    # --use-dpp alone with a graphed split backward's operands copied inside every I (the default leaves them in
    # the backward pool until another backward graph comes first): what the lazy copies buy, TE's layers too.
    "dpp-default-copy-in-i": ("--use-dpp --dpp-graph-operand-copies in-i (as --use-dpp alone, W's operands copied "
                              "inside every I)", 1, ["--use-dpp", "--dpp-graph-operand-copies", "in-i"], True),
    "dpp-v2": ("--use-dpp --dpp-eager --dpp-policy dpp, v=2", 2, ["--use-dpp", "--dpp-eager", "--dpp-policy", "dpp"],
               True),
    # Every graphed line decides with at most one op queued ahead (--dpp-max-queued-ops' default with
    # graphs, trainer/pipeline/run_ahead.py); "-q0" appended gives the unbounded behaviour.
    "dpp-graphs": ("--use-dpp --dpp-policy dpp --dpp-cuda-graphs (transformer blocks replayed from CUDA graphs, "
                   "one per activation slot; hosts at most 1 op ahead, the default with graphs)", 1, ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs"], True),
    "dpp-graphs-cf1.25": ("--use-dpp --dpp-cuda-graphs --dpp-cap-factor 1.25 (1F1B caps x 1.25: 5/3/2/1 at PP=4)", 1,
                          ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-cap-factor", "1.25"], True),
    "dpp-graphs-cf1.5": ("--use-dpp --dpp-cuda-graphs --dpp-cap-factor 1.5 (1F1B caps x 1.5: 6/4/3/1 at PP=4)", 1,
                         ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-cap-factor", "1.5"], True),
    "dpp-graphs-cf1.75": ("--use-dpp --dpp-cuda-graphs --dpp-cap-factor 1.75 (7/5/3/1 at PP=4: the simulator's pick "
                          "for the measured per-hop latency, docs/schedules.md)", 1,
                          ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-cap-factor", "1.75"], True),
    "dpp-graphs-cf2": ("--use-dpp --dpp-cuda-graphs --dpp-cap-factor 2 (8/6/4/2 at PP=4)", 1,
                       ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-cap-factor", "2"], True),
    "dpp-graphs-rc": ("--use-dpp --dpp-cuda-graphs --recompute-activations (1F1B caps; core attention recomputed "
                      "inside the backward graphs)", 1,
                      ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--recompute-activations"], True),
    "dpp-graphs-rc-cf1.5": ("--use-dpp --dpp-cuda-graphs --dpp-cap-factor 1.5 --recompute-activations (core attention "
                            "recomputed inside the backward graphs: a slot holds ~55% of its activations, so 1.5x the "
                            "slots fit megatron's 1F1B memory)", 1,
                            ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-cap-factor", "1.5",
                             "--recompute-activations"], True),
    "dpp-graphs-rc-cf2": ("--use-dpp --dpp-cuda-graphs --dpp-cap-factor 2 --recompute-activations", 1,
                          ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-cap-factor", "2",
                           "--recompute-activations"], True),
    # Per-slot recompute (--dpp-recompute-slots): stage 0, which decides peak memory, recomputes the core
    # attention in 1 (2) of its 4 slots; every other slot and stage keeps its activations.
    "dpp-graphs-rs1": ("--use-dpp --dpp-cuda-graphs --dpp-recompute-slots 1 (one of stage 0's slots recomputes "
                       "the core attention)", 1,
                       ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-recompute-slots", "1"], True),
    "dpp-graphs-rs2": ("--use-dpp --dpp-cuda-graphs --dpp-recompute-slots 2 (two of stage 0's slots recompute "
                       "the core attention)", 1,
                       ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-recompute-slots", "2"], True),
    "dpp-graphs-v2-rc": ("--use-dpp --dpp-cuda-graphs --recompute-activations, v=2", 2,
                         ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--recompute-activations"], True),
    # Graphed v=2 dynamic lines: each chunk held to what the interleaved order holds in it (--dpp-chunk-caps
    # auto), so their slots per chunk are interleaved-graphs' (dpp: the same memory; dpp-zb: plus its W's).
    "dpp-graphs-v2": ("--use-dpp --dpp-policy dpp --dpp-cuda-graphs, v=2", 2,
                      ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs"], True),
    "dpp-graphs-v2-cf1.25": ("--use-dpp --dpp-cuda-graphs --dpp-cap-factor 1.25, v=2", 2,
                             ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-cap-factor", "1.25"], True),
    "dpp-zb": ("--use-dpp --dpp-eager --dpp-policy dpp-zb (split backward, eager)", 1,
               ["--use-dpp", "--dpp-eager", "--dpp-policy", "dpp-zb"], True),
    # Split backward with graphs: each slot holds F, I and W graphs; dpp-zb's held cap is
    # stage 0's 1F1B bound on every stage (4/4/4/4 at PP=4), its live cap the stage's own (4/3/2/1).
    "dpp-zb-graphs": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs (F, I and W graphs per slot)", 1,
                      ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs"], True),
    # The same, W's operands copied out of the backward pool inside every I (the earlier behaviour), where the
    # default copies them only when another backward graph replays before the W (trainer/pipeline/graph_operands.py).
    "dpp-zb-graphs-copy-in-i": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs --dpp-graph-operand-copies in-i "
                                "(W's operands copied inside every I)", 1,
                                ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs",
                                 "--dpp-graph-operand-copies", "in-i"], True),
    "dpp-zb-graphs-rs2": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs --dpp-recompute-slots 2 (two of stage "
                          "0's slots recompute the core attention)", 1,
                          ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs", "--dpp-recompute-slots", "2"],
                          True),
    # dpp-zb held to each stage's own 1F1B bound (4/3/2/1 slots at PP=4) instead of stage 0's on every stage:
    # the memory of the graphed 1F1B order, where a last stage's microbatch costs as much as stage 0's (BERT).
    "dpp-zb-graphs-held-stage": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs --dpp-held-cap stage (each "
                                 "stage holds its own 1F1B bound: 4/3/2/1 slots at PP=4)", 1,
                                 ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs", "--dpp-held-cap",
                                  "stage"], True),
    # dpp-zb holding stage 0's bound on every stage whatever it costs (the graphed default before the held cap
    # was fitted to memory): the speed the fit may give up where a later stage's slots do not fit.
    "dpp-zb-graphs-held-peak": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs --dpp-held-cap peak (stage 0's "
                                "1F1B bound on every stage: 4 slots each at PP=4)", 1,
                                ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs", "--dpp-held-cap",
                                 "peak"], True),
    "dpp-zb-v2": ("--use-dpp --dpp-eager --dpp-policy dpp-zb, v=2", 2, ["--use-dpp", "--dpp-eager", "--dpp-policy",
                                                                         "dpp-zb"], True),
    # Graphed split backward with two chunks per stage: the simulator's fastest line on the benchmark model
    # once the chunks are split in half layers (--pipeline-stage-layers-vp / --resplit auto).
    "dpp-zb-graphs-v2": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs, v=2 (F, I and W graphs per slot of "
                         "each chunk)", 2, ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs"], True),
    # The same, its forwards queued on their input's header (--no-dpp-land-forwards, the earlier behaviour): in the
    # host-time model each waited on the stream for its activation, 29% behind the interleaved order at PP=4.
    "dpp-zb-graphs-v2-headers": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs --no-dpp-land-forwards, v=2 (a "
                                 "forward is queued on its input's header, not after its data landed)", 2,
                                 ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs", "--no-dpp-land-forwards"],
                                 True),
    # The same, the oldest deferred W first (the default before W's operands were copied lazily; see
    # --dpp-weight-order): more W's find another backward before them, and copy their operands first.
    "dpp-zb-graphs-v2-oldest-w": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs --dpp-weight-order oldest, v=2 (the "
                                  "oldest deferred W first)", 2,
                                  ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs", "--dpp-weight-order",
                                   "oldest"], True),
    # The same, each slot with its own set of buffers for W's operands (the earlier layout), where the default's
    # slots share as many sets as pipeline stages at v=2 (--dpp-graph-evacuation-sets): the memory the sharing saves.
    "dpp-zb-graphs-v2-sets-slots": ("--use-dpp --dpp-policy dpp-zb --dpp-cuda-graphs --dpp-graph-evacuation-sets "
                                    "slots, v=2 (a set of W's operand buffers per slot)", 2,
                                    ["--use-dpp", "--dpp-policy", "dpp-zb", "--dpp-cuda-graphs",
                                     "--dpp-graph-evacuation-sets", "slots"], True),
    # The static orders replayed by the DPP runtime (--use-dpp --dpp-policy <order>): the fair bars for the
    # dynamic policies -- same runtime, transport, graphs and run-ahead bound, only the order differs. Graphed,
    # each chunk gets as many slots as the order holds at most (ZB-H1: p on every stage; the log and the
    # peak-reserved column say what that costs).
    "1f1b-graphs": ("--use-dpp --dpp-policy 1f1b --dpp-cuda-graphs (megatron-core's 1F1B order replayed by the DPP "
                    "runtime from the same CUDA graph slots: the graphed static bar)", 1,
                    ["--use-dpp", "--dpp-policy", "1f1b", "--dpp-cuda-graphs"], True),
    "interleaved-graphs": ("--use-dpp --dpp-policy interleaved --dpp-cuda-graphs, v=2 (megatron-core's interleaved "
                           "1F1B order from the same graph slots, as many per chunk as the order holds)", 2,
                           ["--use-dpp", "--dpp-policy", "interleaved", "--dpp-cuda-graphs"], True),
    "zb-h1-graphs": ("--use-dpp --dpp-policy zb-h1 --dpp-cuda-graphs (the static ZB-H1 order, F, I and W graphs per "
                     "slot, p slots on every stage: what ZB-H1 holds)", 1,
                     ["--use-dpp", "--dpp-policy", "zb-h1", "--dpp-cuda-graphs"], True),
    # v=2 at memory parity by recompute, the earlier way to it: without per-chunk caps (--dpp-chunk-caps none)
    # the dynamic policy captures its whole cap in *each* chunk (a forward may take any chunk's slot), the
    # interleaved order only what it holds per chunk, so enough slots per stage recompute the core attention
    # (--dpp-recompute-slots, each chunk's) to come within 1.10x of the interleaved order's slot memory;
    # counts from parity_recompute_slots for the call's PP and M. The graphed v=2 lines above reach parity
    # with per-chunk caps instead (the default), without recompute.
    "dpp-graphs-v2-parity": ("--use-dpp --dpp-policy dpp --dpp-cuda-graphs --dpp-chunk-caps none --dpp-recompute-slots "
                             "<per stage>, v=2 (recomputing slots chosen for <= 1.10x interleaved-graphs' slot memory)",
                             2, ["--use-dpp", "--dpp-policy", "dpp", "--dpp-cuda-graphs", "--dpp-chunk-caps", "none"],
                             True),
    "1f1b-eager": ("--use-dpp --dpp-eager --dpp-policy 1f1b (megatron-core's 1F1B order in the DPP runtime, eager)",
                   1, ["--use-dpp", "--dpp-eager", "--dpp-policy", "1f1b"], True),
    "interleaved-eager": ("--use-dpp --dpp-eager --dpp-policy interleaved, v=2 (the interleaved order in the DPP "
                          "runtime, eager)", 2, ["--use-dpp", "--dpp-eager", "--dpp-policy", "interleaved"], True),
    "zb-h1-eager": ("--use-dpp --dpp-eager --dpp-policy zb-h1 (the static ZB-H1 order in the DPP runtime, eager)", 1,
                    ["--use-dpp", "--dpp-eager", "--dpp-policy", "zb-h1"], True),
    "direct-megatron": ("megatron-core forward_backward driven by a minimal script (trainer.bench.direct), "
                        "1F1B, balanced split, no batch sync", 1, ["--no-batch-p2p-sync"], True),
}
QUEUED_SUFFIX = re.compile(r"^(?P<base>.+)-q(?P<k>0|[1-9][0-9]*)$")
"""``<dpp line>-qK``: that line with ``--dpp-max-queued-ops K`` (decisions near GPU time, run_ahead.py;
``-q0`` = unbounded, the graphed lines' behaviour before the default became 1 with graphs)."""


RECOMPUTING_SLOT_SHARE = 0.55
"""Activation memory of a slot that recomputes its core attention, as a share of one that keeps it (the
benchmark model, h2048 seq 1024 mbs 2: the attention probabilities are most of a layer's saved activations;
trainer/pipeline/cuda_graphs.py)."""


def parity_recompute_slots(pp: int, microbatches: int, vp: int = 2, bound: float = 1.10) -> tuple[int, ...]:
    """Per stage, how many of each chunk's graph slots the dynamic policy must capture recomputing so its
    slot memory stays within ``bound`` x the interleaved order's, without per-chunk caps (``--dpp-chunk-caps
    none``): the dynamic policy then holds its cap in every chunk, the interleaved order its own peak per
    chunk (trainer.pipeline.runtime.graph_slots)."""
    from trainer.schedule.core import PipelineShape
    from trainer.schedule.dynamic import one_f_one_b_cap
    from trainer.schedule.registry import make_policy

    shape = PipelineShape(pp, microbatches, vp)
    counts = []
    for stage in range(pp):
        cap = one_f_one_b_cap(shape, stage)
        static = sum(make_policy("interleaved", shape, stage).held_per_chunk(vp))
        saved_per_slot = vp * (1.0 - RECOMPUTING_SLOT_SHARE)
        need = max(0.0, (vp * cap - bound * static) / saved_per_slot)
        counts.append(min(cap, math.ceil(need - 1e-9)))
    return tuple(counts)


def line_entry(name: str) -> tuple[str, int, list[str], bool] | None:
    """The catalogue entry of ``name`` (what, v, flags, balanced), or of a ``-qK`` variant of a DPP
    line; None for an unknown name."""
    if name in CATALOGUE:
        return CATALOGUE[name]
    match = QUEUED_SUFFIX.match(name)
    base = CATALOGUE.get(match["base"]) if match else None
    if base is None or "--use-dpp" not in base[2] or "--dpp-max-queued-ops" in base[2]:
        return None
    what, vp, flags, balanced = base
    k = match["k"]
    return f"{what}; --dpp-max-queued-ops {k}", vp, [*flags, "--dpp-max-queued-ops", k], balanced


def base_name(name: str) -> str:
    """``name`` without a ``-qK`` suffix (which line of the catalogue it varies)."""
    match = QUEUED_SUFFIX.match(name)
    return match["base"] if match and name not in CATALOGUE else name


DEFAULT_LINES = ("megatron-1f1b-default", "megatron-1f1b-best", "megatron-interleaved-v2", "dpp", "dpp-graphs",
                 "dpp-graphs-cf1.5", "dpp-zb",
                 "dpp-zb-v2", "direct-megatron")
LAYOUT_DEFAULT_LINES = ("megatron-1f1b-best", "dpp-default")
"""--layouts without --lines: per layout, megatron-core's best eager configuration of it against the DPP default."""
SCENARIOS = {"a": "uniform", "b": "variable sequence lengths", "c": "transient stalls",
             "d": "variable sequence lengths of a real corpus"}
SEED = 1234
"""--seed of every line (initialisation and mock data)."""
MEGATRON_LINES = ("megatron-1f1b-default", "megatron-1f1b-best", "megatron-1f1b-best-rc", "megatron-1f1b-graphs",
                  "megatron-interleaved-v2")
"""The trainer's megatron-core lines: the best of them is the bar every ratio is taken against."""
MEGATRON_GRAPHED_LINES = ("megatron-1f1b-graphs",)
"""megatron-core's schedule replaying its own per-layer CUDA graphs: a graphed static order too (the headline's
second bar, beside the runtime's), never its first (megatron-core's best *eager* line)."""
STATIC_GRAPHED_LINES = ("1f1b-graphs", "interleaved-graphs", "zb-h1-graphs")
"""Static orders through the DPP runtime's graphs: the best of them (or of MEGATRON_GRAPHED_LINES) is the
headline's second bar."""
STATIC_EAGER_LINES = ("1f1b-eager", "interleaved-eager", "zb-h1-eager")
"""The same orders eager (the second bar where no graphed one ran, e.g. on CPU: labelled so)."""
STATIC_LINES = STATIC_GRAPHED_LINES + STATIC_EAGER_LINES


@dataclass(frozen=True)
class BenchConfig:
    """Model, layout and run window shared by every line (flags of ``python -m trainer.bench.pipeline``)."""

    device: str = "cuda"
    """cuda (NCCL, one process per GPU) or cpu (gloo dry run)."""
    model: str = "gpt"
    """--model of every line: gpt (megatron-core's GPTModel) or bert (its BertModel, mock masked-LM samples)."""
    num_layers: int = 16
    """Transformer layers."""
    hidden_size: int = 2048
    """Hidden width."""
    num_attention_heads: int = 16
    """Attention heads."""
    seq_length: int = 1024
    """Tokens per sample."""
    vocab_size: int = 50257
    """Mock-data vocabulary (padded by the trainer as Megatron does)."""
    micro_batch_size: int = 2
    """Samples per microbatch."""
    num_microbatches: int = 32
    """Microbatches per iteration (M); the global batch is M x mbs (DP = 1)."""
    pipeline_parallel: int = 4
    """Stages = processes = GPUs."""
    train_iters: int = 20
    """Iterations per line."""
    gpu_busy_iters: int = 2
    """Last iterations run under the kernel profiler (GPU busy time; left out of the timings)."""
    skip_iters: int = 2
    """Iterations left out of the timings at the start (warm-up): statistics use iterations 3+."""
    optimizer: str = "sgd"
    """Optimizer of every line (sgd, as the reference megatron-core measurement, docs/benchmarks.md)."""
    torch_optimizer_impl: str = "auto"
    """Every line's --torch-optimizer-impl (auto: the trainer's default, fused on CUDA; foreach: torch's
    default step, whose temporaries the size of the parameters add to graphed lines' memory)."""
    bf16: bool = True
    """bfloat16 (fp32 main weights)."""
    head_weight: float = 2.0
    """Cost of the output head in layers, for :func:`balanced_split` (about two at 50k vocab, measured on 4xH200)."""
    split: tuple[int, int] | None = None
    """First/last stage layers for v=1 lines; None = :func:`balanced_split`."""
    split_vp: tuple[int, int] | None = None
    """First/last stage layers for v=2 lines; None = :func:`balanced_split` with v=2."""
    pipeline_stage_layers: str = ""
    """Layers of every stage for v=1 lines, the trainer's --pipeline-stage-layers (e.g. 4.5,4.5,4.5,2.5: x.5
    = a stage boundary between a layer's attention and its MLP); replaces --split; v=2 lines keep theirs."""
    pipeline_stage_layers_vp: str = ""
    """Layers of every virtual stage for v=2 lines (2 x PP counts, model order: chunk 0 of every stage
    first), the trainer's --pipeline-stage-layers with --num-virtual-stages-per-pipeline-rank 2; replaces
    --split-vp."""
    attention_share: float = 0.0
    """The attention half's share of a layer's time, for --resplit auto's split in half layers; 0: by the
    model's FLOPs (trainer.measure.flops; 0.36 for gpt16-h2048)."""
    stall: str = "1:0.05:20:1234"
    """``--inject-stalls`` value of scenario (c)."""
    seq_len_dist: str = "lognormal:0.6"
    """``--mock-seq-len-dist`` of scenario (b): mock document lengths, seeded by --seed and sample index."""
    seq_length_divisible_by: int = 64
    """Scenario (b): each microbatch's length is its longest document rounded up to this (capped at seq_length)."""
    corpus: str = ""
    """Scenario (d): a GPT-2-tokenized indexed corpus prefix read with --variable-seq-lengths (one
    document, or piece of a long one, per sample), e.g. the sample corpus after ``python -m
    trainer.preprocess --input datasets/python-docs.jsonl.xz --output-prefix runs/data/gpt2/corpus
    --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt2/vocab.json --merge-file
    datasets/gpt2/merges.txt --append-eod``: runs/data/gpt2/corpus_text_document."""
    vocab_file: str = "datasets/gpt2/vocab.json"
    """Scenario (d): the corpus's GPT-2 vocabulary."""
    merge_file: str = "datasets/gpt2/merges.txt"
    """Scenario (d): the corpus's GPT-2 merges."""
    model_flags: tuple[str, ...] = ()
    """Trainer flags of the model's block for every line (a Llama block's, ``--transformer-impl``): part of
    the model, so a layout naming its own model (``--layouts 4x1x1@NAME``) replaces them."""
    extra: tuple[str, ...] = ()
    """More trainer flags for every line (e.g. ``--transport nccl``)."""
    layout: Layout | None = None
    """TP, DP and their options of this configuration (``--layouts``; trainer/bench/layouts.py); None:
    PP = --pipeline-parallel, TP = DP = 1. Not a flag of its own: set per layout by the command."""
    cpu_bind: str = "numa"
    """CPUs of each rank, the same for every line: numa (the cores of its GPU's NUMA node, shared
    among the ranks there; an even split where the node is unknown; trainer.launch.cpu_binding) or none."""

    @property
    def data_parallel(self) -> int:
        return self.layout.data_parallel if self.layout is not None else 1

    @property
    def world_size(self) -> int:
        return self.layout.world_size if self.layout is not None else self.pipeline_parallel

    @property
    def global_batch_size(self) -> int:
        """M microbatches per data-parallel replica: M x mbs x DP."""
        return self.num_microbatches * self.micro_batch_size * self.data_parallel


def balanced_split(num_layers: int, pp: int, vp: int, head_weight: float) -> tuple[int, int] | None:
    """First/last stage layers of :func:`trainer.schedule.layers.balanced_split` when the output head
    weighs ``head_weight`` layers (16 layers on 4 stages with head 2: 5/3, i.e. 5/4/4/3, the split
    measured best on 4 GPUs; its tie-break says why not the equally costly 4/5/5/2). Both flags are
    given whenever the split is not even, so every line lays it out the same way; None: even."""
    if pp < 2:
        return None
    best = layers.balanced_split(layers.LayerCosts(num_layers, head=head_weight), pp, vp)
    if best.first is None and best.last is None:
        return None
    return best.layers[0], best.layers[-1]


@dataclass(frozen=True)
class Line:
    """One run of the benchmark."""

    name: str
    scenario: str
    label: str
    """What ran, as the report prints it (says when a CPU run stands in for megatron-core)."""
    module: str
    """``trainer.train`` or ``trainer.bench.direct``."""
    args: list[str] = field(default_factory=list)
    split: tuple[int, int] | None = None
    layout: str = ""
    """The layout's label (``--layouts``), or "" for the single layout of --pipeline-parallel."""
    world_size: int = 0
    """Ranks of the run (PP x TP x DP); 0: the configuration's."""

    @property
    def key(self) -> str:
        return f"{self.layout}-{self.scenario}-{self.name}" if self.layout else f"{self.scenario}-{self.name}"


@dataclass(frozen=True)
class NotRun:
    """A line the benchmark could not run, and why (never skipped silently)."""

    name: str
    scenario: str
    reason: str
    layout: str = ""


def common_args(cfg: BenchConfig) -> list[str]:
    args = ["--device", cfg.device, "--mock-data", "--model", cfg.model, "--num-layers", str(cfg.num_layers),
            "--hidden-size", str(cfg.hidden_size), "--num-attention-heads", str(cfg.num_attention_heads),
            "--seq-length", str(cfg.seq_length), "--max-position-embeddings", str(cfg.seq_length),
            "--vocab-size", str(cfg.vocab_size), "--micro-batch-size", str(cfg.micro_batch_size),
            "--global-batch-size", str(cfg.global_batch_size),
            "--pipeline-model-parallel-size", str(cfg.pipeline_parallel), "--train-iters", str(cfg.train_iters),
            "--optimizer", cfg.optimizer, "--torch-optimizer-impl", cfg.torch_optimizer_impl, "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seed", str(SEED), "--log-interval", "1", "--gpu-busy-iters", str(cfg.gpu_busy_iters)]
    layout = cfg.layout.trainer_args() if cfg.layout is not None else []
    return args + layout + (["--bf16"] if cfg.bf16 else []) + list(cfg.model_flags) + list(cfg.extra)


def layer_attention_share(cfg: BenchConfig) -> tuple[float, str]:
    """The attention half's share of a layer's time, and where it comes from: --attention-share; else, on
    CUDA, measured on this GPU for the model every line trains (trainer.measure.layer_halves, a child
    process: kernel times of its two halves, once per model and process -- the re-split and the report
    both ask); else, or where that fails, the model's FLOPs (hidden size, heads, GQA, SwiGLU, MLP width),
    which misjudge memory-bound attention (the module says by how much)."""
    if cfg.attention_share > 0:
        return cfg.attention_share, "--attention-share"
    from trainer.config import parse_config
    from trainer.measure.flops import model_layer_attention_share

    args = tuple(common_args(cfg))
    measured, why = _measured_share(args) if cfg.device == "cuda" else (None, "not on CUDA")
    if measured is not None:
        return measured, why
    return model_layer_attention_share(parse_config(list(args), cfg.world_size).model), f"by the model's FLOPs ({why})"


@functools.cache
def _measured_share(train_args: tuple[str, ...]) -> tuple[float | None, str]:
    """(share, where from) measured by trainer.measure.layer_halves for these trainer flags, or (None, why not)."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "trainer.measure.layer_halves", "--", *train_args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return None, f"its measurement failed (exit {done.returncode}: {done.stderr.strip()[-300:]})"
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        ms = measured["ms"]
        return measured["attention_share"], (f"measured on this GPU: attention half {sum(ms['attention']):.3f} ms, "
                                             f"MLP half {sum(ms['mlp']):.3f} ms of kernels per microbatch")
    except (subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as err:
        return None, f"its measurement failed ({type(err).__name__}: {err})"


def variable_length_args(cfg: BenchConfig) -> list[str]:
    """Trainer flags of scenario (b): the same variable-length mock documents for every line."""
    return ["--variable-seq-lengths", "--mock-seq-len-dist", cfg.seq_len_dist,
            "--seq-length-divisible-by", str(cfg.seq_length_divisible_by)]


def corpus_args(cfg: BenchConfig) -> list[str]:
    """Trainer flags of scenario (d): the real corpus, each microbatch as long as its documents."""
    return ["--data-path", cfg.corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", cfg.vocab_file,
            "--merge-file", cfg.merge_file, "--variable-seq-lengths",
            "--seq-length-divisible-by", str(cfg.seq_length_divisible_by)]


def variable_length_tokens(cfg: BenchConfig, scenario: str = "b") -> tuple[float, float]:
    """Scenario (b)'s or (d)'s mean tokens per iteration over the run: (real tokens, tokens after
    bucketing, padding included). Computed from the same samples the lines train on: the seeded mock
    documents (b), or the corpus's pieces in the trainer's order (d)."""
    from trainer.data.varlen import LENGTH_KEY, Bucketing, parse_length_distribution
    from trainer.model.batches import mock_sample_source

    if scenario == "d":
        from trainer.data.gpt_dataset import GPTDocumentDataset

        dataset = GPTDocumentDataset(cfg.corpus, cfg.seq_length, SEED, num_samples=cfg.train_iters * cfg.global_batch_size)
        source = dataset.__getitem__
    else:
        dist, problems = parse_length_distribution(cfg.seq_len_dist)
        raise_if_any(problems if dist is None else [])
        source = mock_sample_source(cfg.model, SEED, cfg.seq_length, cfg.vocab_size, dist)
    bucketing = Bucketing(cfg.seq_length_divisible_by, cfg.seq_length)
    real = padded = 0
    mbs = cfg.micro_batch_size
    for first in range(0, cfg.train_iters * cfg.global_batch_size, mbs):
        samples = [source(i) for i in range(first, first + mbs)]
        real += sum(int(s[LENGTH_KEY]) for s in samples)
        batch = bucketing.apply(samples)[0]
        padded += mbs * len(batch["tokens"] if "tokens" in batch else batch["text"])  # GPT's batch, BERT's
    return real / cfg.train_iters, padded / cfg.train_iters


def stage_layers_field(vp: int) -> str:
    """The BenchConfig field of the lines of ``vp`` chunks per stage that gives every (virtual) stage's count."""
    return "pipeline_stage_layers" if vp == 1 else "pipeline_stage_layers_vp"


def _split_for(cfg: BenchConfig, vp: int) -> tuple[int, int] | None:
    given = cfg.split if vp == 1 else cfg.split_vp
    return given if given is not None else balanced_split(cfg.num_layers, cfg.pipeline_parallel, vp, cfg.head_weight)


def plan(cfg: BenchConfig, names: list[str], scenarios: list[str],
         available_policies: tuple[str, ...]) -> list[Line | NotRun]:
    """The runs, in order, and the lines that cannot run here with the reason."""
    out: list[Line | NotRun] = []
    for scenario in scenarios:
        for name in names:
            what, vp, flags, balanced = line_entry(name)
            reason = _cannot_run(cfg, name, flags, available_policies, scenario)
            if reason:
                out.append(NotRun(name, scenario, reason, cfg.layout.label if cfg.layout is not None else ""))
                continue
            split = _split_for(cfg, vp) if balanced else None
            stage_layers = getattr(cfg, stage_layers_field(vp)) if balanced else ""
            if stage_layers:  # every stage's count given: Megatron's first/last flags would contradict it
                split = None
            args = common_args(cfg) + flags
            if base_name(name) == "dpp-graphs-v2-parity":
                counts = parity_recompute_slots(cfg.pipeline_parallel, cfg.num_microbatches, vp)
                args += ["--dpp-recompute-slots", ",".join(map(str, counts))]
            if scenario == "d":  # the corpus instead of mock tokens; its tokenizer gives the vocabulary
                args = [a for a in args if a != "--mock-data"] + corpus_args(cfg)
            if vp > 1:
                args += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
            if split is not None:
                args += ["--decoder-first-pipeline-num-layers", str(split[0]),
                         "--decoder-last-pipeline-num-layers", str(split[1])]
            if stage_layers:
                args += ["--pipeline-stage-layers", stage_layers]
            if scenario == "b":
                args += variable_length_args(cfg)
            if scenario == "c":
                args += ["--inject-stalls", cfg.stall]
            args += ["--run-name", f"bench-{scenario}-{name}"]
            label = what
            if cfg.device == "cpu" and name.startswith("megatron-"):
                schedule = _schedule_of(args, cfg.world_size)  # what the trainer's plan runs instead (PP x TP x DP ranks)
                label = f"CPU stand-in: our runtime's static {schedule.policy} policy (what the trainer runs on CPU " \
                        "without --use-dpp, trainer.config.plan.uses_megatron_schedule); " + what.split(", ", 1)[-1]
            module = "trainer.bench.direct" if name == "direct-megatron" else "trainer.train"
            out.append(Line(name, scenario, label, module, args, split,
                            cfg.layout.label if cfg.layout is not None else "", cfg.world_size))
    return out


def _schedule_of(args: list[str], world_size: int):
    """The schedule the trainer's run plan picks for these flags (trainer.config.plan)."""
    from trainer.config import parse_config, resolve_plan

    return resolve_plan(parse_config(args, world_size), world_size).schedule


def _cannot_run(cfg: BenchConfig, name: str, flags: list[str], available_policies: tuple[str, ...],
                scenario: str = "a") -> str:
    graphs = "--dpp-cuda-graphs" in flags or "--cuda-graph-impl" in flags
    if graphs and cfg.device != "cuda":
        return "CUDA graphs need CUDA"
    if "--cuda-graph-impl" in flags and scenario == "b":
        return "megatron-core's local CUDA graphs capture one sequence length; scenario (b) varies it"
    if scenario == "d" and not cfg.corpus:
        return "scenario (d) needs --corpus PREFIX (a GPT-2-tokenized indexed corpus, e.g. the sample corpus)"
    if scenario == "d" and cfg.model != "gpt":
        return (f"scenario (d) reads a GPT-2-tokenized corpus; --model {cfg.model} needs a WordPiece one "
                "(the trainer refuses it, trainer/config/layout.py)")
    if scenario == "d" and name == "direct-megatron":
        return "trainer.bench.direct builds mock microbatches only; scenario (d) reads a corpus"
    if name == "direct-megatron" and cfg.layout is not None and cfg.world_size != cfg.pipeline_parallel:
        return "trainer.bench.direct drives a pipeline only (TP = DP = 1); the layout's megatron line is megatron-1f1b-best"
    if name == "direct-megatron" and cfg.device != "cuda":
        return "trainer.bench.direct runs on CUDA only; no CPU stand-in for this line"
    if "--dpp-policy" in flags:
        policy = flags[flags.index("--dpp-policy") + 1]
        if policy not in available_policies:
            return f"this checkout's trainer has no --dpp-policy {policy} (accepted: {', '.join(available_policies) or 'none'})"
    if name == "megatron-interleaved-v2" and cfg.device == "cuda" and cfg.num_microbatches % cfg.pipeline_parallel:
        return f"megatron-core's interleaved schedule needs M ({cfg.num_microbatches}) divisible by PP"
    if ("interleaved" in flags or name.startswith("dpp-graphs-v2-parity")) and cfg.num_microbatches % cfg.pipeline_parallel:
        return f"the interleaved 1F1B order needs M ({cfg.num_microbatches}) divisible by PP"
    return ""
