"""Data through megatron-core's dataset builder (trainer/data/megatron_datasets.py):
--data-path blends, --split of documents, the index cache, and GPT and BERT samples as the trainer
reads them.

The datasets are written with megatron-core's IndexedDatasetBuilder so that every token says where it
came from: document d of dataset s holds only the token ``1000 * s + d`` (plus 1 for its last token),
so a sample's tokens name its dataset and documents. megatron-core's BlendedDataset reads the global
rank (torch.distributed) once it caches, so the tests run inside a one-process gloo group.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from tests.corpus import DATASETS, small_corpus
from trainer.data.megatron_datasets import (
    Blend,
    MegatronSamples,
    SplitSizes,
    bert_samples,
    check_helpers,
    gpt_samples,
    parse_blend,
)
from trainer.launch.ports import free_port

SEQ = 16
DOCS = 40
DOC_TOKENS = 24
VOCAB = 4096


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """megatron-core's builder synchronises ranks through the default group (here a group of one)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _write(prefix: Path, source: int) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(VOCAB))
    for doc in range(DOCS):
        tokens = np.full(DOC_TOKENS, 1000 * source + doc, dtype=np.int64)
        builder.add_document(tokens, [DOC_TOKENS])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("megatron-data")
    return _write(folder / "a_text_document", 1), _write(folder / "b_text_document", 2)


def _samples(blend: Blend, split: str, sizes: SplitSizes, cache: Path, seed: int = 5) -> MegatronSamples:
    return gpt_samples(blend, split, SEQ, seed, sizes, "NullTokenizer", VOCAB, VOCAB - 1, str(cache))


def _origins(sample: dict) -> set[tuple[int, int]]:
    """(dataset, document) of every token of a sample (inputs and the final label)."""
    tokens = np.concatenate([sample["tokens"], sample["labels"][-1:]])
    return {(int(t) // 1000, int(t) % 1000) for t in tokens}


def test_parse_blend_reads_megatron_lms_data_path() -> None:
    assert parse_blend(["A"]) == (Blend(("A",)), [])
    assert parse_blend(["0.3", "A", "0.7", "B"]) == (Blend(("A", "B"), (0.3, 0.7)), [])
    assert parse_blend(["A", "B"]) == (Blend(("A", "B")), [])  # unweighted: blended by size
    assert parse_blend([]) == (None, [])
    assert parse_blend(["0.3", "A", "0.7"])[1] == [
        "--data-path 0.3 A 0.7: weights and prefixes must alternate (WEIGHT PREFIX WEIGHT PREFIX ...); 0.3 0.7 "
        "looks like a weight without its dataset"]
    assert parse_blend(["-1", "A", "2", "B"])[1] == ["--data-path -1 A 2 B: blend weights must be >= 0 with a positive sum"]


def test_helpers_are_built() -> None:
    check_helpers()  # megatron-core's wheel ships helpers_cpp: nothing is compiled at run time


def test_samples_are_windows_shifted_by_one(corpora, tmp_path) -> None:
    source = _samples(Blend((corpora[0],)), "1,0,0", SplitSizes(30), tmp_path)
    sample = source.sample("train", 7)
    assert {k: (v.shape, v.dtype) for k, v in sample.items()} == {
        "tokens": ((SEQ,), np.int64), "labels": ((SEQ,), np.int64),
        "loss_mask": ((SEQ,), np.float32), "position_ids": ((SEQ,), np.int64)}
    assert np.array_equal(sample["tokens"][1:], sample["labels"][:-1])
    assert np.array_equal(sample["position_ids"], np.arange(SEQ)) and sample["loss_mask"].sum() == SEQ
    with pytest.raises(IndexError, match="valid sample 0 outside the 0"):
        source.sample("valid", 0)


def test_samples_are_a_function_of_split_index_and_seed(corpora, tmp_path) -> None:
    first = _samples(Blend((corpora[0],)), "1,0,0", SplitSizes(30), tmp_path / "one")
    again = _samples(Blend((corpora[0],)), "1,0,0", SplitSizes(30), tmp_path / "two")  # built afresh
    order = [0, 5, 29, 17, 5]
    forward = [first.sample("train", k) for k in order]
    backward = [again.sample("train", k) for k in reversed(order)][::-1]
    assert all(all(np.array_equal(a[key], b[key]) for key in a) for a, b in zip(forward, backward, strict=True))
    other = _samples(Blend((corpora[0],)), "1,0,0", SplitSizes(30), tmp_path / "three", seed=6)
    assert not all(np.array_equal(first.sample("train", k)["tokens"], other.sample("train", k)["tokens"])
                   for k in range(5))


def test_one_epoch_tiles_the_document_stream(corpora, tmp_path) -> None:
    per_epoch = (DOCS * DOC_TOKENS - 1) // SEQ
    source = _samples(Blend((corpora[0],)), "1,0,0", SplitSizes(per_epoch), tmp_path)
    inputs = np.concatenate([source.sample("train", k)["tokens"] for k in range(per_epoch)])
    counts = np.bincount(inputs - 1000, minlength=DOCS)
    assert len(inputs) == per_epoch * SEQ and counts.max() <= DOC_TOKENS  # no token read twice in an epoch
    assert DOCS * DOC_TOKENS - len(inputs) < SEQ + 1  # and at most the last partial window left out


def test_split_gives_each_share_its_own_documents(corpora, tmp_path) -> None:
    """--split 8,1,1 of 40 documents: megatron-core's document ranges [0, 32), [32, 36), [36, 40)."""
    source = _samples(Blend((corpora[0],)), "8,1,1", SplitSizes(60, 20, 10), tmp_path)
    seen = {split: set().union(*(_origins(source.sample(split, k)) for k in range(n)))
            for split, n in (("train", 60), ("valid", 20), ("test", 10))}
    assert {doc for _, doc in seen["train"]} == set(range(32))
    assert {doc for _, doc in seen["valid"]} == set(range(32, 36))
    assert {doc for _, doc in seen["test"]} == set(range(36, 40))


def test_a_split_asked_for_samples_without_documents_is_an_error(corpora, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"--split 99,1,0 gives the test split none of the 40 documents of "
                                         r".*a_text_document, but 4 test samples are needed"):
        _samples(Blend((corpora[0],)), "99,1,0", SplitSizes(10, 0, 4), tmp_path)


def test_an_unwritable_cache_folder_is_named(corpora, tmp_path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(RuntimeError, match=r"caches its dataset indices in .*a-file/cache, which rank 0 cannot "
                                           r"create \(.*\): give --data-cache-path a writable folder"):
        _samples(Blend((corpora[0],)), "1,0,0", SplitSizes(10), tmp_path / "a-file" / "cache")


def test_blend_follows_the_weights_sample_by_sample(corpora, tmp_path) -> None:
    """--data-path 0.3 A 0.7 B: megatron-core's blending index gives, after every n samples, each dataset
    its weight x n to within one sample, and the samples really are that dataset's."""
    n = 200
    source = _samples(Blend(corpora, (0.3, 0.7)), "1,0,0", SplitSizes(n), tmp_path)
    from_a = 0
    for k in range(n):
        datasets = {dataset for dataset, _ in _origins(source.sample("train", k))}
        assert datasets == {source.dataset_of("train", k) + 1}, k  # one dataset per sample, the one indexed
        from_a += datasets == {1}
        assert abs(from_a - 0.3 * (k + 1)) <= 1, (k, from_a)
    assert from_a == 60


def test_blend_weights_are_normalised_and_unweighted_blends_go_by_size(corpora, tmp_path) -> None:
    weighted = _samples(Blend(corpora, (3.0, 7.0)), "1,0,0", SplitSizes(100), tmp_path / "w")
    assert sum(weighted.dataset_of("train", k) == 0 for k in range(100)) == 30
    by_size = _samples(Blend(corpora), "1,0,0", SplitSizes(100), tmp_path / "s")  # equal sizes: half each
    assert sum(by_size.dataset_of("train", k) == 0 for k in range(100)) == 50


def test_indices_are_cached_and_read_back(corpora, tmp_path) -> None:
    cache = tmp_path / "cache"
    first = _samples(Blend(corpora, (0.5, 0.5)), "8,2,0", SplitSizes(40, 10), cache)
    files = sorted(cache.iterdir())
    kinds = {path.name.split("-", 1)[1] for path in files}
    assert {"GPTDataset-train-sample_index.npy", "GPTDataset-valid-shuffle_index.npy",
            "BlendedDataset-train-dataset_index.npy", "BlendedDataset-valid-dataset_sample_index.npy"} <= kinds
    stamps = {path: path.stat().st_mtime_ns for path in files}
    again = _samples(Blend(corpora, (0.5, 0.5)), "8,2,0", SplitSizes(40, 10), cache)
    assert {path: path.stat().st_mtime_ns for path in sorted(cache.iterdir())} == stamps  # read, not rebuilt
    for split, count in (("train", 40), ("valid", 10)):
        for k in range(count):
            assert np.array_equal(first.sample(split, k)["tokens"], again.sample(split, k)["tokens"])


# ---- BERT -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_corpus(tmp_path_factory):
    """80 documents of the shipped corpus, sentence-split and WordPiece-tokenized (python -m trainer.preprocess)."""
    from trainer.data.preprocess import main as preprocess_main
    from trainer.data.tokenizer import build_tokenizer

    folder = tmp_path_factory.mktemp("bert")
    small_corpus(folder / "slice.jsonl", 80)
    vocab = DATASETS / "bert" / "vocab.txt"
    assert preprocess_main(["--input", str(folder / "slice.jsonl"), "--output-prefix", str(folder / "bert"),
                            "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab),
                            "--split-sentences"]) == 0
    return str(folder / "bert_text_sentence"), build_tokenizer("BertWordPieceLowerCase", vocab)


def test_bert_samples_are_megatron_cores_masked_pairs(bert_corpus, tmp_path) -> None:
    prefix, tok = bert_corpus
    source = bert_samples(Blend((prefix,)), "9,1,0", 64, 3, SplitSizes(200, 20), tok, cache_dir=str(tmp_path))
    predicted_share = []
    for k in range(0, 200, 5):
        s = source.sample("train", k)
        assert {key: s[key].dtype for key in ("text", "types", "labels", "padding_mask", "loss_mask")} == {
            "text": np.int64, "types": np.int64, "labels": np.int64, "padding_mask": np.int64, "loss_mask": np.float32}
        assert s["text"].shape == (64,) and int(s["is_random"]) in (0, 1)
        real = int(s["padding_mask"].sum())
        text = s["text"][:real]
        seps = np.flatnonzero(text == tok.sep)
        assert text[0] == tok.cls and len(seps) == 2 and seps[1] == real - 1, text
        assert np.all(s["padding_mask"][:real] == 1) and np.all(s["padding_mask"][real:] == 0)
        predicted = s["loss_mask"] == 1
        assert np.all(s["labels"][~predicted] == -1) and np.all(s["labels"][predicted] >= 0)
        predicted_share.append(predicted.sum() / (real - 3))
    assert 0.1 < float(np.mean(predicted_share)) <= 0.16  # Megatron-LM's 15% of the word pieces
    again = bert_samples(Blend((prefix,)), "9,1,0", 64, 3, SplitSizes(200, 20), tok, cache_dir=str(tmp_path / "b"))
    for split, k in (("train", 7), ("valid", 3), ("train", 199)):
        first, second = source.sample(split, k), again.sample(split, k)
        assert all(np.array_equal(first[key], second[key]) for key in first)


def test_config_reads_blends_and_refuses_what_the_builder_cannot_serve() -> None:
    from trainer.config import ConfigError, parse_config

    gpt2 = ["--vocab-file", "v.json", "--merge-file", "m.txt"]
    cfg = parse_config(["--data-path", "0.3", "A", "0.7", "B", "--data-cache-path", "/c", *gpt2], world_size=1)
    assert (cfg.data.data_path, cfg.data.data_cache_path) == (("0.3", "A", "0.7", "B"), "/c")
    with pytest.raises(ConfigError) as err:
        parse_config(["--data-path", "0.3", "A", "0.7", "B", "--variable-seq-lengths", "--data-cache-path", "/c",
                      "--model", "bert", "--seq-length", "64", "--seq-length-divisible-by", "8", *gpt2], world_size=1)
    assert set(err.value.problems) == {
        "--variable-seq-lengths reads one --data-path prefix (samples that carry their own length, which "
        "megatron-core's dataset builder does not offer), got 2 to blend",
        "--data-cache-path=/c caches megatron-core's dataset indices, which --mock-data and --variable-seq-lengths "
        "do not build"}
    with pytest.raises(ConfigError) as err:  # a layout-level check: after the field checks pass
        parse_config(["--data-path", "A", "--model", "bert", *gpt2], world_size=1)
    assert err.value.problems == ["BERT needs a WordPiece tokenizer: --model bert with --data-path needs "
                                  "--tokenizer-type BertWordPieceLowerCase or BertWordPieceCase and its --vocab-file "
                                  "(got GPT2BPETokenizer (the default))"]
