"""Layout checks: what no single section can check -- the world size, the layer split, the batch,
the nodes, and the rules between sections. :func:`layout_problems` runs every check, the schedule's
refusals (:func:`trainer.config.plan.schedule_problems`) included, and lists every problem at once.
"""

from __future__ import annotations

from trainer.config.llama import llama_layout_problems
from trainer.config.plan import (
    graph_problems,
    megatron_batch_problems,
    megatron_p2p_problems,
    schedule_problems,
    static_order_problems,
)
from trainer.config.training import DataConfig, TrainConfig
from trainer.config.transformer_engine import attention_backend_problems
from trainer.data.split import parse_split
from trainer.launch.node_addresses import read_node_ips
from trainer.schedule.layers import stage_split_problems
from trainer.schedule.stage_parts import stage_layers_problems


def _stage_split_problems(cfg: TrainConfig) -> list[str]:
    """How the layers cannot be placed on the pipeline stages (and virtual stages): trainer.schedule.layers's rules."""
    m, par = cfg.model, cfg.parallel
    if par.pipeline_stage_layers:
        return stage_layers_problems(m.num_layers, par.pipeline_model_parallel_size, cfg.virtual_pipeline,
                                     par.pipeline_stage_layers)
    return stage_split_problems(m.num_layers, par.pipeline_model_parallel_size, par.decoder_first_pipeline_num_layers,
                                par.decoder_last_pipeline_num_layers, par.num_virtual_stages_per_pipeline_rank,
                                par.num_layers_per_virtual_pipeline_stage)


def _batch_problems(cfg: TrainConfig, dp: int) -> list[str]:
    """How the global batch cannot be cut into microbatches for ``dp`` data-parallel replicas; with
    --rampup-batch-size, every batch size of the ramp (Megatron-LM checks each when the ramp reaches
    it, mid-run; here all are checked before start-up).

    Fewer microbatches than pipeline stages is allowed, as in Megatron-LM (its 1F1B warms up with
    min(PP - rank - 1, M) forwards; a ramp starting at 16 samples under PP=16 x DP=2 begins there):
    the runtime's 1F1B and ZB-H1 orders take the same minimum and the dynamic policies' caps are
    min(1F1B bound, M). Only the interleaved orders need M to be a multiple of PP (megatron-core's
    and the runtime's: :func:`~trainer.config.plan.megatron_batch_problems`, ``static_order_problems``)."""
    o = cfg.optim
    p: list[str] = []
    for size in o.batch_sizes:
        flag = f"--global-batch-size={size}" if size == o.global_batch_size and len(o.batch_sizes) == 1 \
            else f"global batch size {size} (of --rampup-batch-size up to --global-batch-size={o.global_batch_size})"
        if size % (o.micro_batch_size * dp):
            p.append(f"{flag} is not divisible by --micro-batch-size={o.micro_batch_size} x data-parallel size {dp}")
            continue
        microbatches = size // (o.micro_batch_size * dp)
        p.extend(megatron_batch_problems(cfg, microbatches))
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
    p.extend(megatron_p2p_problems(cfg))
    if par.sequence_parallel and tp > 1:
        p.extend(_sequence_parallel_problems(cfg))
    if cfg.validates and cfg.data.split is not None and parse_split(cfg.data.split)[0][1] == 0:
        p.append(f"--eval-interval={cfg.run.eval_interval} needs validation samples but --split="
                 f"{cfg.data.split} gives the valid share 0")
    p.extend(_variable_length_problems(cfg))
    p.extend(_bert_data_problems(cfg))
    p.extend(llama_layout_problems(cfg))
    p.extend(schedule_problems(cfg))
    p.extend(graph_problems(cfg))
    p.extend(static_order_problems(cfg, world_size))
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
