"""GPTSampleDataset / BertSampleDataset over real preprocessed slices of the shipped corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.corpus import DATASETS, GPT2_FILES
from trainer.data.bert_dataset import NOT_PREDICTED, BertSampleDataset, build_sentence_groups
from trainer.data.gpt_dataset import GPTSampleDataset
from trainer.data.indexed import collate_samples, open_indexed_dataset
from trainer.data.preprocess import main as preprocess_main
from trainer.data.tokenizer import build_tokenizer

BERT_VOCAB = DATASETS / "bert" / "vocab.txt"


# corpus_slice (the first 150 documents of the shipped corpus) and gpt2_corpus (the same tokenized with
# GPT-2 BPE) are tests/conftest.py's.
@pytest.fixture(scope="module")
def bert_prefix(corpus_slice, tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("bert") / "bert"
    assert preprocess_main(["--input", str(corpus_slice), "--output-prefix", str(prefix), "--tokenizer-type",
                            "BertWordPieceLowerCase", "--vocab-file", str(BERT_VOCAB), "--split-sentences"]) == 0
    return f"{prefix}_text_sentence"


@pytest.fixture(scope="module")
def bert_tokenizer():
    return build_tokenizer("BertWordPieceLowerCase", BERT_VOCAB)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- GPT --------------------------------------------------------------------------------------------
def test_gpt_sample_shapes_and_shift(gpt2_corpus):
    dataset = GPTSampleDataset(gpt2_corpus, seq_length=64, seed=3)
    sample = dataset[7]
    assert {k: (v.shape, v.dtype) for k, v in sample.items()} == {
        "tokens": ((64,), np.int64), "labels": ((64,), np.int64),
        "loss_mask": ((64,), np.float32), "position_ids": ((64,), np.int64)}
    assert np.array_equal(sample["tokens"][1:], sample["labels"][:-1])
    assert np.array_equal(sample["position_ids"], np.arange(64)) and sample["loss_mask"].sum() == 64
    batch = collate_samples([dataset[0], dataset[1]])
    assert tuple(batch["tokens"].shape) == (2, 64) and str(batch["loss_mask"].dtype) == "torch.float32"


def test_gpt_samples_are_a_function_of_index_and_seed(gpt2_corpus):
    first, again = GPTSampleDataset(gpt2_corpus, 64, seed=3), GPTSampleDataset(gpt2_corpus, 64, seed=3)
    indices = [0, 5, len(first) - 1, 17, 5]
    forward = [first[i] for i in indices]
    backward = [again[i] for i in reversed(indices)][::-1]  # another instance, another access order
    assert all(_same(a, b) for a, b in zip(forward, backward, strict=True))
    other_seed = GPTSampleDataset(gpt2_corpus, 64, seed=4)
    assert not all(_same(first[i], other_seed[i]) for i in range(5))


def test_gpt_epoch_tiles_the_token_stream(gpt2_corpus):
    dataset = GPTSampleDataset(gpt2_corpus, 64, seed=0)
    indexed = open_indexed_dataset(gpt2_corpus)  # its arrays are views of its mmap: keep it alive
    all_tokens = np.concatenate(list(indexed))
    epoch_inputs = np.concatenate([dataset[i]["tokens"] for i in range(dataset.samples_per_epoch)])
    assert len(epoch_inputs) == dataset.samples_per_epoch * 64 == (len(all_tokens) - 1) // 64 * 64
    spare = np.bincount(all_tokens, minlength=8192) - np.bincount(epoch_inputs, minlength=8192)
    assert spare.min() >= 0 and spare.sum() == len(all_tokens) - len(epoch_inputs)  # each token used once


def test_gpt_sample_is_a_window_of_the_documents(tmp_path):
    docs = [" ".join(f"alpha{i}" for i in range(40)), " ".join(f"omega{i}" for i in range(30))]
    src = tmp_path / "two.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "two"), "--tokenizer-type",
                            "GPT2BPETokenizer", *GPT2_FILES]) == 0
    ids = [np.array(d, dtype=np.int64) for d in open_indexed_dataset(tmp_path / "two_text_document")]
    streams = [np.concatenate(ids), np.concatenate(ids[::-1])]
    dataset = GPTSampleDataset(tmp_path / "two_text_document", seq_length=9, seed=1, num_samples=40)
    assert len(dataset) == 40 > dataset.samples_per_epoch  # runs into further epochs
    for i in range(len(dataset)):
        window = np.concatenate([dataset[i]["tokens"], dataset[i]["labels"][-1:]])
        assert any(any(np.array_equal(window, s[k:k + 10]) for k in range(0, len(s) - 9, 9)) for s in streams), i


def test_gpt_bad_arguments(gpt2_corpus, tmp_path):
    with pytest.raises(ValueError, match=r"seq_length=0 must be >= 1; num_samples=0"):
        GPTSampleDataset(gpt2_corpus, 0, seed=0, num_samples=0)
    with pytest.raises(ValueError, match=r"fewer than seq_length \+ 1 = 10000001"):
        GPTSampleDataset(gpt2_corpus, 10_000_000, seed=0)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nothing.idx")):
        GPTSampleDataset(tmp_path / "nothing", 8, seed=0)
    with pytest.raises(IndexError, match="outside"):
        GPTSampleDataset(gpt2_corpus, 64, seed=0, num_samples=3)[3]


# GPT-2 has no pad token; pad = eod is what Megatron does for GPT-2 too, and pretraining samples are never padded.
@pytest.mark.filterwarnings("ignore:The pad token id in the tokenizer collides")
def test_megatron_cores_own_gpt_dataset_reads_our_files(gpt2_corpus, corpus_slice, tmp_path):
    """Interoperability: megatron-core's GPTDataset (index building included) runs on our output, offline."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import Split

    tokenizer = build_tokenizer("GPT2BPETokenizer", DATASETS / "gpt2" / "vocab.json", DATASETS / "gpt2" / "merges.txt")

    class MegatronTokenizerView:  # the attributes megatron-core's GPTDataset reads from its tokenizer
        eod = pad = tokenizer.eod
        vocab_size = tokenizer.vocab_size
        unique_identifiers = {"class": "GPT2BPETokenizer"}

    config = GPTDatasetConfig(
        random_seed=1, sequence_length=32, tokenizer=MegatronTokenizerView(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(tmp_path), split="100,0,0",
        blend=([gpt2_corpus], None), allow_ambiguous_pad_tokens=True)
    indexed = open_indexed_dataset(gpt2_corpus)
    dataset = GPTDataset(indexed, gpt2_corpus, np.arange(len(indexed), dtype=np.int32), 50, Split.train, config)
    sample = dataset[0]
    assert tuple(sample["tokens"].shape) == (32,) and np.array_equal(sample["tokens"][1:], sample["labels"][:-1])
    corpus = "\n".join(json.loads(line)["text"] for line in corpus_slice.read_text().splitlines())
    for piece in tokenizer.detokenize(sample["tokens"].tolist()).split("<|endoftext|>"):
        assert piece in corpus, piece  # the tokens are a window of our documents


# ---- BERT -------------------------------------------------------------------------------------------
def test_build_sentence_groups():
    bounds = np.array([0, 1, 4, 9])  # docs: 1 sentence, 3 sentences, 5 sentences
    lengths = np.array([50, 10, 10, 10, 30, 30, 30, 30, 1])
    groups = build_sentence_groups(bounds, lengths, max_tokens=45, min_sentences=2)
    # doc 0 is too short for a pair; doc 1 never fills 45 tokens; doc 2's 1-sentence tail joins its group
    assert groups.tolist() == [[1, 4], [4, 6], [6, 9]]
    assert build_sentence_groups(bounds, lengths, 45, 1).tolist() == [[0, 1], [1, 4], [4, 6], [6, 8], [8, 9]]


def test_bert_sample_layout(bert_prefix, bert_tokenizer):
    tok = bert_tokenizer
    dataset = BertSampleDataset(bert_prefix, seq_length=96, tokenizer=tok, seed=5)
    indexed = open_indexed_dataset(bert_prefix)
    for index in range(0, len(dataset), max(1, len(dataset) // 40)):
        s = dataset[index]
        for key in ("text", "types", "labels", "padding_mask"):
            assert s[key].shape == (96,) and s[key].dtype == np.int64, key
        assert s["loss_mask"].dtype == np.float32 and s["is_random"] in (0, 1)
        real = int(s["padding_mask"].sum())
        assert np.all(s["padding_mask"][:real] == 1) and np.all(s["text"][real:] == tok.pad)
        text = s["text"][:real]
        seps = np.flatnonzero(text == tok.sep)
        assert text[0] == tok.cls and len(seps) == 2 and seps[1] == real - 1
        assert np.array_equal(s["types"][:real], (np.arange(real) > seps[0]).astype(np.int64))
        predicted = s["loss_mask"] == 1
        assert np.all(s["labels"][~predicted] == NOT_PREDICTED) and np.all(s["labels"][predicted] >= 0)
        assert predicted.sum() == max(1, round((real - 3) * 0.15))
        # Undo the masking: the pair is the sample's own sentences (when neither swapped nor trimmed).
        original = np.where(predicted[:real], s["labels"][:real], text)
        if not s["is_random"] and not s["truncated"]:
            first, end = dataset.sentence_range(index)
            sentences = np.concatenate([indexed[i] for i in range(first, end)])
            assert np.array_equal(np.delete(original, [0, *seps]), sentences)


def test_bert_masking_and_swap_statistics(bert_prefix, bert_tokenizer):
    dataset = BertSampleDataset(bert_prefix, seq_length=64, tokenizer=bert_tokenizer, seed=11)
    samples = [dataset[i] for i in range(min(len(dataset), 600))]
    kept = masked = replaced = 0
    for s in samples:
        predicted = s["loss_mask"] == 1
        masked += int(np.sum(s["text"][predicted] == bert_tokenizer.mask))
        kept += int(np.sum(s["text"][predicted] == s["labels"][predicted]))
        replaced += int(np.sum((s["text"][predicted] != bert_tokenizer.mask)
                               & (s["text"][predicted] != s["labels"][predicted])))
    total = masked + kept + replaced
    assert total > 3000
    assert abs(masked / total - 0.8) < 0.03 and abs(kept / total - 0.1) < 0.03 and abs(replaced / total - 0.1) < 0.03
    assert abs(np.mean([s["is_random"] for s in samples]) - 0.5) < 0.07


def test_bert_samples_are_a_function_of_index_and_seed(bert_prefix, bert_tokenizer):
    first = BertSampleDataset(bert_prefix, 64, bert_tokenizer, seed=2, num_samples=500)
    again = BertSampleDataset(bert_prefix, 64, bert_tokenizer, seed=2, num_samples=500)
    indices = [0, 9, 499, 250, 9]
    forward = [first[i] for i in indices]
    backward = [again[i] for i in reversed(indices)][::-1]
    assert all(_same(a, b) for a, b in zip(forward, backward, strict=True))
    other = BertSampleDataset(bert_prefix, 64, bert_tokenizer, seed=3, num_samples=500)
    assert not all(_same(first[i], other[i]) for i in range(5))


def test_bert_without_binary_head_has_one_segment(bert_prefix, bert_tokenizer):
    dataset = BertSampleDataset(bert_prefix, 64, bert_tokenizer, seed=0, binary_head=False)
    for i in range(20):
        s = dataset[i]
        real = int(s["padding_mask"].sum())
        assert np.sum(s["text"][:real] == bert_tokenizer.sep) == 1 and not s["types"].any() and s["is_random"] == 0


def test_bert_bad_arguments(gpt2_corpus, bert_prefix, bert_tokenizer):
    with pytest.raises(ValueError, match=r"seq_length=4 must be >= 5.*masked_lm_prob=0.0 must be in \(0, 1\)"):
        BertSampleDataset(bert_prefix, 4, bert_tokenizer, seed=0, masked_lm_prob=0.0)
    with pytest.raises(ValueError, match="--split-sentences"):  # one sequence per document: no pairs
        BertSampleDataset(gpt2_corpus, 64, bert_tokenizer, seed=0)


# ---- a .bin that does not match its .idx is named when opened, not mid-training -----------------
@pytest.mark.parametrize("change", [-2, 4], ids=["short", "long"])
def test_bin_size_is_checked_against_the_index_when_opened(gpt2_corpus, bert_prefix, bert_tokenizer, tmp_path,
                                                           change):
    import shutil

    for source, name in ((gpt2_corpus, "gpt"), (bert_prefix, "bert")):
        copy = tmp_path / name
        shutil.copy(source + ".idx", f"{copy}.idx")
        data = Path(source + ".bin").read_bytes()
        Path(f"{copy}.bin").write_bytes(data[:change] if change < 0 else data + b"\0" * change)
        expected = rf"{copy}\.bin is {len(data) + change} bytes but {copy}\.idx describes {len(data)} bytes"
        with pytest.raises(ValueError, match=expected):
            open_indexed_dataset(copy)
        with pytest.raises(ValueError, match=expected):
            if name == "gpt":
                GPTSampleDataset(copy, 64, seed=0)
            else:
                BertSampleDataset(copy, 64, bert_tokenizer, seed=0)
