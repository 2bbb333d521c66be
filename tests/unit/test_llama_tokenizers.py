"""Llama2Tokenizer and HuggingFaceTokenizer (--tokenizer-model), built from tokenizers the project trains
on the shipped corpus (trainer/data/train_tokenizer.py), give Megatron-LM's ids: BOS before every text
and EOS as end of document for Llama2Tokenizer (its _Llama2Tokenizer wrapper), the fast tokenizer's
ids with its own special tokens for HuggingFaceTokenizer (transformers' AutoTokenizer, checked
against it where transformers is installed); preprocessing writes those ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data.tokenizer import HuggingFaceTokenizer, Llama2Tokenizer, build_tokenizer
from trainer.data.train_tokenizer import corpus_texts, train_huggingface, train_sentencepiece

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "datasets" / "python-docs.jsonl.xz"


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return list(corpus_texts(CORPUS, 300))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, texts) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tokenizers")
    return {"sp": train_sentencepiece(texts[:250], folder / "sp", 600),
            "hf": train_huggingface(texts[:250], folder / "hf", 600).parent}


def test_llama2_tokenizer_ids_are_megatron_lms(trained, texts) -> None:
    import sentencepiece

    tok = build_tokenizer("Llama2Tokenizer", None, None, trained["sp"])
    assert isinstance(tok, Llama2Tokenizer)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(trained["sp"]))
    assert (tok.vocab_size, tok.bos, tok.eod) == (sp.get_piece_size(), sp.bos_id(), sp.eos_id()) == (600, 1, 2)
    for text in texts[250:] + ["", "ünïcödé ✓ 🙂"]:
        # Megatron-LM's _Llama2Tokenizer.tokenize(s) = [bos_id] + SentencePiece's encode(s); no EOS.
        assert tok.tokenize(text) == [sp.bos_id(), *sp.encode(text)]
    assert tok.detokenize(tok.tokenize("def f(x): return x")[1:]) == "def f(x): return x"


def test_huggingface_tokenizer_ids_are_megatron_lms(trained, texts) -> None:
    tok = build_tokenizer("HuggingFaceTokenizer", None, None, trained["hf"])
    assert isinstance(tok, HuggingFaceTokenizer)
    # The folder and its tokenizer.json read the same.
    same = HuggingFaceTokenizer(trained["hf"] / "tokenizer.json")
    assert (tok.vocab_size, tok.eod) == (same.vocab_size, same.eod) == (600, 2)
    assert all(tok.tokenize(t)[0] == 1 for t in texts[250:])  # the post-processor's <s>
    transformers = pytest.importorskip("transformers")
    # Megatron-LM's _HuggingFaceTokenizer: AutoTokenizer(path)(text).input_ids, eod = eos_token_id,
    # vocab_size = len(tokenizer).
    reference = transformers.AutoTokenizer.from_pretrained(str(trained["hf"]))
    assert (len(reference), reference.eos_token_id) == (tok.vocab_size, tok.eod)
    for text in texts[250:] + ["ünïcödé ✓ 🙂"]:
        assert tok.tokenize(text) == reference(text).input_ids


def test_tokenizer_model_errors_name_the_file(tmp_path: Path, trained) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer model .*not found: .*missing.model"):
        Llama2Tokenizer(tmp_path / "missing.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot read SentencePiece model .*bad.model"):
        Llama2Tokenizer(tmp_path / "bad.model")
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found: .*nothing is downloaded"):
        HuggingFaceTokenizer(tmp_path)
    no_eos = tmp_path / "no-eos"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_text((trained["hf"] / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="no eos_token in tokenizer_config.json or special_tokens_map.json"):
        HuggingFaceTokenizer(no_eos)
    (no_eos / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert HuggingFaceTokenizer(no_eos).eod == 2


def test_training_the_tokenizers_is_deterministic(tmp_path: Path, texts, trained) -> None:
    import sentencepiece

    # The model file also records its own output path (trainer_spec.model_prefix): compare what it holds.
    again = train_sentencepiece(texts[:250], tmp_path / "sp", 600)
    pieces = [[(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
              for sp in (sentencepiece.SentencePieceProcessor(model_file=str(m)) for m in (again, trained["sp"]))]
    assert pieces[0] == pieces[1]
    assert train_huggingface(texts[:250], tmp_path / "hf", 600).read_text() == \
        (trained["hf"] / "tokenizer.json").read_text()


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "HuggingFaceTokenizer"])
def test_preprocessing_writes_megatron_lms_ids(kind: str, trained, texts, tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    model = trained["sp"] if kind == "Llama2Tokenizer" else trained["hf"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[250:260]))
    result = subprocess.run([sys.executable, "-m", "trainer.preprocess", "--input", str(jsonl), "--output-prefix",
                             str(tmp_path / "out"), "--tokenizer-type", kind, "--tokenizer-model", str(model),
                             "--append-eod", "--log-interval", "5"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    # Megatron-LM's progress line: documents/s and MB/s.
    assert "Processed 5 documents (" in result.stderr and " docs/s, " in result.stderr
    tok = build_tokenizer(kind, None, None, model)
    written = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(written) == 10
    for i, text in enumerate(texts[250:260]):
        assert np.asarray(written[i]).tolist() == tok.tokenize(text) + [tok.eod]


def test_preprocessing_needs_the_tokenizer_model(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "trainer.preprocess", "--input", str(CORPUS), "--output-prefix",
                             str(tmp_path / "out"), "--tokenizer-type", "Llama2Tokenizer"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "tokenizer_type='Llama2Tokenizer' needs tokenizer_model (--tokenizer-model)" in result.stderr
