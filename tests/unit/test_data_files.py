"""The shipped sample corpus, tokenizer files and Punkt model, and the tokenizer wrappers over them."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from trainer.data.sentence_splitter import load_sentence_splitter
from trainer.data.tokenizer import GPT2_EOD, build_tokenizer
from trainer.names import FILE_TOKENIZERS

DATASETS = Path(__file__).resolve().parents[2] / "datasets"
GPT2_VOCAB, GPT2_MERGES = DATASETS / "gpt2" / "vocab.json", DATASETS / "gpt2" / "merges.txt"
BERT_VOCAB = DATASETS / "bert" / "vocab.txt"


def test_corpus_is_real_text_of_the_promised_size():
    corpus = DATASETS / "python-docs.jsonl.xz"
    assert corpus.stat().st_size < 3_000_000
    raw = lzma.decompress(corpus.read_bytes())
    assert len(raw) >= 5_000_000
    records = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    assert len(records) > 1000
    assert all(isinstance(r["text"], str) and r["text"].strip() for r in records)
    words = " ".join(r["text"] for r in records[:200]).split()
    assert sum(w.lower() in {"the", "a", "of", "is", "to"} for w in words) / len(words) > 0.05  # English prose
    readme = (DATASETS / "README.md").read_text()
    for fact in ("python3.11-doc", "PSF", "build_corpus.py", "build_tokenizers.py", "8192"):
        assert fact in readme, f"datasets/README.md does not mention {fact}"


def test_gpt2_files_and_tokenizer():
    vocab = json.loads(GPT2_VOCAB.read_text())
    assert len(vocab) == 8192 and GPT2_EOD in vocab
    assert GPT2_MERGES.read_text().startswith("#version")
    tokenizer = build_tokenizer("GPT2BPETokenizer", GPT2_VOCAB, GPT2_MERGES)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (8192, vocab[GPT2_EOD], vocab[GPT2_EOD])
    text = "  Leading spaces, tabs\tand unicode: naïve 東京 🙂\n"
    ids = tokenizer.tokenize(text)
    assert all(0 <= i < 8192 for i in ids) and tokenizer.detokenize(ids) == text
    assert len(tokenizer.tokenize("The function returns the value of the attribute.")) < 12  # learned merges


def test_bert_files_and_tokenizer():
    assert BERT_VOCAB.read_text().splitlines()[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = build_tokenizer("BertWordPieceLowerCase", BERT_VOCAB)
    assert tokenizer.vocab_size == 8192
    assert (tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (0, 2, 3, 4)
    ids = tokenizer.tokenize("The Interpreter RETURNS a Value.")
    assert tokenizer.cls not in ids and tokenizer.sep not in ids
    assert tokenizer.detokenize(ids) == "the interpreter returns a value."


def test_cased_bert_tokenizer_keeps_case_and_accents():
    cased, uncased = (build_tokenizer(name, BERT_VOCAB) for name in ("BertWordPieceCase", "BertWordPieceLowerCase"))
    assert (cased.vocab_size, cased.pad, cased.cls, cased.sep, cased.mask) == (8192, 0, 2, 3, 4)
    assert cased.detokenize(cased.tokenize("the interpreter returns a value.")) == "the interpreter returns a value."
    assert cased.tokenize("The Naïve Value") != uncased.tokenize("The Naïve Value")
    assert "naive" in uncased.detokenize(uncased.tokenize("Naïve")) and "naive" not in cased.detokenize(
        cased.tokenize("Naïve"))


def test_every_file_tokenizer_is_built():
    for name in FILE_TOKENIZERS:
        assert build_tokenizer(name, GPT2_VOCAB if name == "GPT2BPETokenizer" else BERT_VOCAB, GPT2_MERGES).name == name


def test_punkt_model_splits_sentences_and_knows_abbreviations():
    splitter = load_sentence_splitter()
    text = "Use a container, e.g. a list. It grows as needed! Does it shrink? No, i.e. never."
    assert splitter.tokenize(text) == ["Use a container, e.g. a list.", "It grows as needed!", "Does it shrink?",
                                       "No, i.e. never."]


def test_missing_tokenizer_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "merges.txt")):
        build_tokenizer("GPT2BPETokenizer", GPT2_VOCAB, tmp_path / "merges.txt")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "vocab.txt")):
        build_tokenizer("BertWordPieceLowerCase", tmp_path / "vocab.txt")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "english.json")):
        load_sentence_splitter(tmp_path / "english.json")
    with pytest.raises(ValueError, match="needs a merge file"):
        build_tokenizer("GPT2BPETokenizer", GPT2_VOCAB)
    with pytest.raises(ValueError, match="'SentencePiece' is not one of"):
        build_tokenizer("SentencePiece", GPT2_VOCAB)


def test_bad_tokenizer_files_are_named(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(ValueError, match=rf"{vocab} lacks the special tokens \['\[CLS\]', '\[SEP\]', '\[MASK\]'\]"):
        build_tokenizer("BertWordPieceLowerCase", vocab)
    bad_json = tmp_path / "vocab.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match=str(bad_json)):
        build_tokenizer("GPT2BPETokenizer", bad_json, GPT2_MERGES)
