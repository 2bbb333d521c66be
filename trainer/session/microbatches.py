"""The microbatch plumbing of a training run: which samples each microbatch of a step holds (the train
share of --split from the consumed samples on, or the valid share while validating), their host
batches, their cost estimates for --variable-seq-lengths, and the device copies the schedules fetch.

One object, :class:`MicrobatchFeed`, so that the loop only says "a step begins" or "this is
evaluation step k"; the schedules ask it for microbatch m by index (the runtime) or through
Megatron-style iterators (megatron-core).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.config import TrainConfig
from trainer.data.split import SampleSplit
from trainer.data.varlen import LENGTH_KEY, Bucketing, bucket_length, parse_length_distribution
from trainer.launch.topology import Topology
from trainer.model.batches import BatchPlan, SampleSource, causal_mask, host_batch, mock_sample_source
from trainer.model.prefetch import MicrobatchPrefetcher

Samples = Callable[[str, int], dict]
"""(split name, k) -> sample k of that share of the data."""


class MicrobatchFeed:
    """This rank's microbatches, step by step."""

    def __init__(self, cfg: TrainConfig, topology: Topology, device: torch.device, num_microbatches: int,
                 consumed_samples: Callable[[], int]) -> None:
        self.cfg, self.topology, self.device = cfg, topology, device
        self.num_microbatches = num_microbatches
        self.consumed_samples = consumed_samples  # the training state's count, read at each step
        self.split = SampleSplit.parse(cfg.sample_split)
        # Set only while validating: the global index of this evaluation step's first valid sample.
        self.eval_start: int | None = None
        self._samples_base: tuple | None = None  # (eval start, consumed samples) of _samples_of
        self._samples_of: dict[int, list] = {}
        self.samples, self.vocab_size = self._sample_source()
        self.prefetcher = MicrobatchPrefetcher(self.host_microbatch, device)

    def begin_step(self, num_microbatches: int | None = None) -> None:
        """A step (training or evaluation) begins: the prefetcher starts on its microbatches.
        ``num_microbatches``: this step's count where it changes between steps (--rampup-batch-size)."""
        if num_microbatches is not None:
            self.num_microbatches = num_microbatches
        self.prefetcher.begin_step(self.num_microbatches)

    # ---- samples ---------------------------------------------------------------------------
    def _sample_source(self) -> tuple[Samples, int]:
        """(split name, k) -> sample k of that split, and the vocabulary size. --data-path goes through
        megatron-core's dataset builder (its --split of documents, blends, index cache); mock data and
        --variable-seq-lengths are the project's index -> sample functions, split by index."""
        cfg = self.cfg
        m, seed = cfg.model, cfg.optim.seed
        if cfg.data.mock_data:
            lengths = (parse_length_distribution(cfg.data.mock_seq_len_dist)[0]
                       if cfg.data.variable_seq_lengths else None)
            return self._by_index(mock_sample_source(m.model, seed, m.seq_length, m.vocab_size, lengths)), m.vocab_size
        gbs = cfg.optim.global_batch_size
        train = cfg.optim.total_iters * gbs
        valid = cfg.optim.total_iters // cfg.run.eval_interval * cfg.run.eval_iters * gbs if cfg.validates else 0
        if cfg.data.tokenizer_type == "NullTokenizer":
            vocab, tokenizer = m.vocab_size, None
        else:
            from trainer.data.tokenizer import build_tokenizer

            tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.vocab_file, cfg.data.merge_file,
                                        cfg.data.tokenizer_model)
            vocab = tokenizer.vocab_size
        if not cfg.data.variable_seq_lengths:
            from trainer.data.megatron_datasets import SplitSizes, bert_samples, gpt_samples, parse_blend

            blend, split, sizes = parse_blend(cfg.data.data_path)[0], cfg.sample_split or "1,0,0", SplitSizes(train, valid)
            if m.model == "gpt":
                source = gpt_samples(blend, split, m.seq_length, seed, sizes, cfg.data.tokenizer_type, vocab,
                                     tokenizer.eod if tokenizer is not None else vocab - 1, cfg.data.data_cache_path)
            else:
                source = bert_samples(blend, split, m.seq_length, seed, sizes, tokenizer,
                                      cache_dir=cfg.data.data_cache_path)
            return source.sample, vocab
        # --variable-seq-lengths: the project's datasets, whose samples carry their real length.
        total = max(self.split.span("train", train), self.split.span("valid", valid))
        (prefix,) = cfg.data.data_path  # config allows one prefix here
        if m.model == "gpt":
            from trainer.data.gpt_dataset import GPTDocumentDataset

            dataset = GPTDocumentDataset(prefix, m.seq_length, seed, num_samples=total,
                                         pad_id=tokenizer.pad if tokenizer is not None else 0)
        else:
            from trainer.data.bert_dataset import BertSampleDataset

            dataset = BertSampleDataset(prefix, m.seq_length, tokenizer, seed, num_samples=total)
        return self._by_index(dataset.__getitem__), vocab

    def _by_index(self, source: SampleSource) -> Samples:
        """An index -> sample function read through --split's share of sample indices (trainer/data/split.py)."""
        return lambda split, k: source(self.split.index(split, k))

    def step_samples(self, microbatch: int) -> list:
        """Samples of microbatch m of this step on this DP rank: the train share of --split from
        consumed_samples on, or while validating the valid share from the evaluation step's start."""
        # Read once per step: --variable-seq-lengths asks for every microbatch's lengths at the step's
        # start (costs) and the prefetcher for the same samples again; on a launch-bound host the
        # second read (mock generation or index lookups, ~0.1 ms a sample) is pure loss.
        base = (self.eval_start, self.consumed_samples())
        if self._samples_base != base:
            self._samples_base, self._samples_of = base, {}
        if microbatch not in self._samples_of:
            topo, o = self.topology, self.cfg.optim
            plan = BatchPlan(o.micro_batch_size, topo.data_parallel, topo.dp_rank)
            if self.eval_start is None:
                samples = [self.samples("train", k) for k in plan.indices(base[1], microbatch)]
            else:
                samples = [self.samples("valid", k) for k in plan.indices(self.eval_start, microbatch)]
            self._samples_of[microbatch] = samples
        return self._samples_of[microbatch]

    # ---- batches ---------------------------------------------------------------------------
    def host_microbatch(self, microbatch: int) -> dict[str, torch.Tensor]:
        d = self.cfg.data
        bucketing = Bucketing(d.seq_length_divisible_by, self.cfg.model.seq_length) if d.variable_seq_lengths else None
        return host_batch(self.step_samples(microbatch), self.cfg.model.model, bucketing)

    def costs(self) -> list[float]:
        """This step's cost estimate per microbatch from its bucketed length (every stage of the
        pipeline reads the same samples, so all agree): (1 - a) r + a r^2 with r = length /
        --seq-length and a = 0.2 for attention's quadratic share (trainer.schedule's cost model)."""
        d = self.cfg.data
        seq = self.cfg.model.seq_length
        costs = []
        for m in range(self.num_microbatches):
            lengths = [sample[LENGTH_KEY] for sample in self.step_samples(m)]
            r = bucket_length(lengths, d.seq_length_divisible_by, seq) / seq
            costs.append(0.8 * r + 0.2 * r * r)
        return costs

    def microbatch(self, microbatch: int, chunk: int = 0) -> dict[str, torch.Tensor]:
        """Microbatch m of this step on the device (copied ahead by the prefetcher: no host wait)."""
        batch = self.prefetcher.get(microbatch)
        if self.cfg.model.model == "gpt":
            batch = {**batch, "attention_mask": causal_mask(batch["tokens"].shape[1], self.device)}
        return batch

    def data_iterators(self) -> list:
        """Megatron-style iterators (one per chunk) over this step's microbatches, by index. Lazy: a
        microbatch is fetched when its forward asks for it (the prefetcher keeps two ahead), so the
        schedule's first forward is queued at once instead of after all M microbatches were built
        and copied (host work added to the pipeline's fill on a launch-bound stage 0; not measured)."""
        return [(self.microbatch(m, c) for m in range(self.num_microbatches))
                for c in range(self.topology.virtual_pipeline)]
