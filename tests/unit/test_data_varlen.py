"""--variable-seq-lengths data: bucketing, mock document lengths, GPT document samples, flag checks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.corpus import preprocess_gpt2, small_corpus
from trainer.config import ConfigError, parse_config
from trainer.data.gpt_dataset import GPTDocumentDataset
from trainer.data.indexed import open_indexed_dataset
from trainer.data.varlen import (
    LENGTH_KEY,
    Bucketing,
    LengthDistribution,
    bucket_length,
    mock_document_length,
    parse_length_distribution,
)
from trainer.model.batches import BatchPlan, host_batch, mock_sample_source


def test_bucket_length_rounds_up_and_caps() -> None:
    assert bucket_length([3, 17], 8, 64) == 24
    assert bucket_length([64], 8, 64) == 64
    assert bucket_length([61], 8, 62) == 62  # capped at --seq-length even off the multiple
    assert bucket_length([1], 64, 1024) == 64


def test_parse_length_distribution_names_the_bad_value() -> None:
    assert parse_length_distribution("lognormal:0.6") == (LengthDistribution(0.6), [])
    assert parse_length_distribution("lognormal:0.6:300")[0] == LengthDistribution(0.6, 300)
    for bad in ("lognormal", "normal:0.6", "lognormal:x", "lognormal:0", "lognormal:0.6:0", "lognormal:nan"):
        dist, problems = parse_length_distribution(bad)
        assert dist is None and len(problems) == 1 and repr(bad) in problems[0]


def test_mock_lengths_are_seeded_spread_and_bounded() -> None:
    dist = LengthDistribution(0.6)
    lengths = [mock_document_length(1234, i, 1024, dist) for i in range(2000)]
    assert lengths == [mock_document_length(1234, i, 1024, dist) for i in range(2000)]
    assert lengths != [mock_document_length(99, i, 1024, dist) for i in range(2000)]
    assert 1 <= min(lengths) and max(lengths) == 1024
    # mean-one ratio x 512, a little below 512 after the cap; the spread is the log-normal's
    assert 440 < np.mean(lengths) < 520 and 0.45 < np.std(lengths) / np.mean(lengths) < 0.7


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_microbatches_are_bucketed_and_the_same_in_every_dp_layout(model: str) -> None:
    seq, mbs, gbs = 64, 2, 16
    source = mock_sample_source(model, 7, seq, 128, LengthDistribution(0.6))
    bucketing = Bucketing(8, seq)

    def microbatches(dp: int) -> dict[tuple[int, ...], dict]:
        out = {}
        for rank in range(dp):
            plan = BatchPlan(mbs, dp, rank)
            for m in range(gbs // (mbs * dp)):
                indices = tuple(plan.indices(gbs, m))  # the second iteration
                out[indices] = host_batch([source(i) for i in indices], model, bucketing)
        return out

    reference, split = microbatches(1), microbatches(2)
    assert reference.keys() == split.keys()
    lengths = set()
    for indices, batch in reference.items():
        assert all(np.array_equal(batch[k], split[indices][k]) for k in batch)
        assert LENGTH_KEY not in batch
        length = next(iter(batch.values())).shape[1]
        real = max(source(i)[LENGTH_KEY] for i in indices)
        assert length == bucket_length([real], 8, seq) and all(t.shape[1] == length for t in batch.values()
                                                                if t.dim() == 2)
        lengths.add(length)
        mask = batch["loss_mask"] if model == "gpt" else batch["padding_mask"]
        for row, i in enumerate(indices):  # real positions first, then padding
            assert int(mask[row].count_nonzero()) <= source(i)[LENGTH_KEY]
            if model == "gpt":
                assert int(mask[row].sum()) == source(i)[LENGTH_KEY]
    assert len(lengths) >= 3  # the point: microbatches of different lengths


def test_fixed_path_unchanged_without_lengths() -> None:
    fixed = mock_sample_source("gpt", 7, 32, 128)(5)
    assert LENGTH_KEY not in fixed and fixed["tokens"].shape == (32,) and fixed["loss_mask"].all()


@pytest.fixture(scope="module")
def gpt_prefix(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("varlen-corpus")
    return preprocess_gpt2(small_corpus(folder / "slice.jsonl", 40), folder / "gpt")


def test_gpt_document_samples_cover_each_document_once_per_epoch(gpt_prefix: str) -> None:
    seq = 256
    dataset = GPTDocumentDataset(gpt_prefix, seq, seed=3)
    indexed = open_indexed_dataset(gpt_prefix)
    documents = [np.array(indexed[i]) for i in range(len(indexed))]
    lengths = dataset.piece_lengths()
    assert lengths.max() == seq and lengths.min() >= 1 and len(set(lengths.tolist())) > 10
    for i in range(len(dataset)):
        s = dataset[i]
        n = s[LENGTH_KEY]
        assert s["tokens"].shape == (seq,) and s["loss_mask"].sum() == n and not s["loss_mask"][n:].any()
        assert np.array_equal(s["tokens"][1:n], s["labels"][: n - 1])
        assert np.array_equal(s["position_ids"], np.arange(seq))
    # every input position of every document appears in exactly one piece
    assert sum(dataset[i][LENGTH_KEY] for i in range(len(dataset))) == sum(max(len(d) - 1, 0) for d in documents)
    again = GPTDocumentDataset(gpt_prefix, seq, seed=3)
    for i in reversed(range(0, len(dataset), 7)):  # any access order, same sample
        assert all(np.array_equal(again[i][k], dataset[i][k]) for k in ("tokens", "labels", "loss_mask"))


def _problems(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(["--device", "cpu", *argv], world_size=2)
    return str(err.value)


def test_bad_variable_length_flags_are_named_before_any_process_group() -> None:
    message = _problems(["--mock-data", "--variable-seq-lengths"])
    assert "needs --mock-seq-len-dist" in message
    message = _problems(["--mock-data", "--variable-seq-lengths", "--mock-seq-len-dist", "uniform:3",
                         "--seq-length-divisible-by", "0"])
    assert "--mock-seq-len-dist='uniform:3'" in message and "--seq-length-divisible-by=0 must be >= 1" in message
    message = _problems(["--mock-data", "--mock-seq-len-dist", "lognormal:0.6"])
    assert "needs --mock-data and --variable-seq-lengths" in message
    message = _problems(["--mock-data", "--variable-seq-lengths", "--mock-seq-len-dist", "lognormal:0.6",
                         "--seq-length", "64", "--seq-length-divisible-by", "128"])
    assert "--seq-length-divisible-by=128 is larger than --seq-length=64" in message
    ok = parse_config(["--device", "cpu", "--mock-data", "--variable-seq-lengths", "--mock-seq-len-dist",
                       "lognormal:0.6", "--pipeline-model-parallel-size", "2"], world_size=2)
    assert ok.data.variable_seq_lengths and ok.data.seq_length_divisible_by == 64
