#!/usr/bin/env python3
"""Train the shipped tokenizer files offline from the sample corpus (datasets/python-docs.jsonl.xz).

Writes, next to this script:
  gpt2/vocab.json, gpt2/merges.txt   GPT-2-style byte-level BPE, ``<|endoftext|>`` as the only special token
  bert/vocab.txt                     BERT WordPiece, lowercase, [PAD] [UNK] [CLS] [SEP] [MASK] first
  punkt/english.json                 NLTK Punkt sentence-boundary parameters (JSON, not pickle)

Usage (from the repository root, with the package installed: ``pip install -e .``)::

    python3 datasets/build_tokenizers.py                  # vocab sizes 8192 / 8192, as shipped

A rebuild reproduces gpt2/ and punkt/ byte for byte; HF's WordPiece trainer breaks frequency ties in
hash-map order, so a rebuilt bert/vocab.txt may order a few tied pieces differently (README.md).
"""

from __future__ import annotations

import json
import lzma
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from nltk.tokenize.punkt import PunktTrainer
from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer

from trainer.cli import OneLineParser
from trainer.data.sentence_splitter import punkt_params_to_json

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "python-docs.jsonl.xz"
GPT2_EOD = "<|endoftext|>"
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def corpus_texts(path: Path) -> Iterator[str]:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_gpt2_bpe(corpus: Path, out_dir: Path, vocab_size: int) -> None:
    # add_prefix_space=False is GPT-2's own setting: the first word of a text has no leading space.
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(
        corpus_texts(corpus), vocab_size=vocab_size, min_frequency=2, special_tokens=[GPT2_EOD],
        show_progress=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_model(str(out_dir))


def train_bert_wordpiece(corpus: Path, out_dir: Path, vocab_size: int) -> None:
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(
        corpus_texts(corpus), vocab_size=vocab_size, min_frequency=2, special_tokens=BERT_SPECIAL_TOKENS,
        show_progress=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_model(str(out_dir))


def train_punkt(corpus: Path, out_file: Path) -> None:
    trainer = PunktTrainer()
    for text in corpus_texts(corpus):
        trainer.train(text, finalize=False)
    trainer.finalize_training()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(punkt_params_to_json(trainer.get_params()), indent=0) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python3 datasets/build_tokenizers.py", description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--output-dir", type=Path, default=HERE)
    parser.add_argument("--gpt2-vocab-size", type=int, default=8192)
    parser.add_argument("--bert-vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    steps = [
        ("gpt2 byte-level BPE", lambda: train_gpt2_bpe(args.corpus, args.output_dir / "gpt2", args.gpt2_vocab_size)),
        ("bert WordPiece", lambda: train_bert_wordpiece(args.corpus, args.output_dir / "bert", args.bert_vocab_size)),
        ("punkt", lambda: train_punkt(args.corpus, args.output_dir / "punkt" / "english.json")),
    ]
    for name, step in steps:
        start = time.perf_counter()
        step()
        print(f"trained {name} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
