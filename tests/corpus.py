"""Real text for the tests: the first documents of the shipped corpus, raw or tokenized.

Every tier that reads real data cuts the same corpus (datasets/python-docs.jsonl.xz, one JSON object
with a "text" per line) to a few documents, so that tokenizing takes seconds; the cut is written here
once. tests/conftest.py turns the common case (150 documents, GPT-2 BPE) into session fixtures.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

__all__ = ["DATASETS", "GPT2_FILES", "SHIPPED_CORPUS", "preprocess_gpt2", "small_corpus"]

DATASETS = Path(__file__).resolve().parents[1] / "datasets"
SHIPPED_CORPUS = DATASETS / "python-docs.jsonl.xz"
GPT2_FILES = ["--vocab-file", str(DATASETS / "gpt2" / "vocab.json"),
              "--merge-file", str(DATASETS / "gpt2" / "merges.txt")]
"""The GPT-2 tokenizer's files as the trainer and the preprocessing take them."""


def small_corpus(path: Path, documents: int = 300) -> Path:
    """The first ``documents`` lines of the shipped corpus, uncompressed, written to ``path``."""
    with lzma.open(SHIPPED_CORPUS, "rt", encoding="utf-8") as src:
        lines = [next(src) for _ in range(documents)]
    assert all(json.loads(line)["text"] for line in lines)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def preprocess_gpt2(jsonl: Path, prefix: Path) -> str:
    """``jsonl`` tokenized as Megatron-LM's GPT recipes do (GPT-2 BPE, ``--append-eod``); the dataset's
    prefix (``--data-path``). In this process: the preprocessing's own tests cover its command line."""
    from trainer.data.preprocess import main as preprocess_main  # torch: only when a test needs it

    assert preprocess_main(["--input", str(jsonl), "--output-prefix", str(prefix),
                            "--tokenizer-type", "GPT2BPETokenizer", *GPT2_FILES, "--append-eod"]) == 0
    return f"{prefix}_text_document"
