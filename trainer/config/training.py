"""The data, checkpoint and job sections, and :class:`TrainConfig`, the whole configuration.

Field checks only (``__post_init__``); see trainer/config/sections.py for the conventions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainer.config.optim import OptimConfig
from trainer.config.sections import ModelConfig, ParallelConfig, _check
from trainer.data.megatron_datasets import parse_blend
from trainer.data.split import MEGATRON_DEFAULT_SPLIT, parse_split
from trainer.data.varlen import parse_length_distribution
from trainer.names import MODEL_FILE_TOKENIZERS, TOKENIZERS, TokenizerType
from trainer.schedule.stall_injection import stall_problems


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
    """``--device``: cuda (NCCL) or cpu (gloo, megatron-core with trainer.megatron.compat shims)."""
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
    (trainer/launch/node_addresses.py). The first is the rendezvous host when MASTER_ADDR is not set."""
    profile_dir: str | None = None
    """Write per-rank Chrome traces here (``--profile-dir``)."""
    log_interval: int = 1
    """Iterations between log lines (``--log-interval``)."""
    metrics_dir: str | None = None
    """Each rank writes ``metrics_rank<R>.json`` here at the end (``--metrics-dir``): per-iteration
    ms, losses, peak GPU memory, GPU busy time -- what the pipeline benchmark reads, not log text."""
    log_throughput: bool = False
    """Add Megatron-LM's ``throughput per GPU (TFLOP/s/GPU)`` to each iteration line
    (``--log-throughput``): its model-FLOPs count (trainer/measure/flops.py) / (iteration time x world size)."""
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
    on CUDA), the same ops under every schedule for one seed (trainer/schedule/stall_injection.py)."""
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
    record_memory_history: bool = False
    """Megatron-LM's ``--record-memory-history``: the CUDA allocator records every allocation and free with
    its stack from before the model is built; snapshots after iteration 1, every --log-interval iterations
    and at an out-of-memory error (trainer/profiling/memory_history.py). Every rank writes its own file
    (Megatron-LM: the last rank only). ``python -m trainer.profiling.memory_summary FILE`` says where the
    reserved memory goes; https://pytorch.org/memory_viz draws it. CUDA only."""
    memory_snapshot_path: str | None = None
    """With --record-memory-history: the snapshot file, ``snapshot.pickle`` if not given (Megatron-LM's
    ``--memory-snapshot-path``); rank R writes ``<stem>_rank<R><suffix>`` beside it."""
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
        if self.record_memory_history and self.device != "cuda":
            p.append(f"--record-memory-history records the CUDA allocator: it needs --device cuda (got {self.device})")
        if self.memory_snapshot_path is not None and not self.record_memory_history:
            p.append(f"--memory-snapshot-path={self.memory_snapshot_path} needs --record-memory-history (without it "
                     "no snapshot is taken)")
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
