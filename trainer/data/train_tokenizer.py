"""Train a small tokenizer from a JSONL corpus, offline: the files ``--tokenizer-model`` reads.

``python -m trainer.data.train_tokenizer --kind sentencepiece|huggingface --input CORPUS.jsonl[.xz|.gz]
--output-dir DIR [--vocab-size N] [--max-documents N]`` writes

* sentencepiece: ``DIR/tokenizer.model``, a Llama-style SentencePiece BPE model (``<unk>`` 0, ``<s>`` 1,
  ``</s>`` 2, byte fallback), for ``--tokenizer-type Llama2Tokenizer``;
* huggingface: ``DIR/tokenizer.json`` (byte-level BPE whose post-processor puts ``<s>`` in front of
  every text, as Llama's does) with ``tokenizer_config.json`` naming its BOS/EOS/UNK tokens, for
  ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``.

Why: Llama-2's own tokenizer files need a registration to download; a tokenizer trained here on the
shipped corpus gives tests and small runs the same code path with nothing fetched. Training is
deterministic for one input and vocabulary size (one thread, fixed seed), so the same files come back.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from trainer.cli import OneLineParser

SPECIAL = ("<unk>", "<s>", "</s>")


def corpus_texts(path: Path, max_documents: int | None, key: str = "text") -> Iterator[str]:
    """The ``key`` field of the first ``max_documents`` lines of a JSONL file (.xz/.gz read too)."""
    from trainer.data.preprocess import _open_input

    with _open_input(path) as handle:
        for number, raw in enumerate(handle, start=1):
            if max_documents is not None and number > max_documents:
                return
            if raw.strip():
                text = json.loads(raw).get(key)
                if isinstance(text, str) and text:
                    yield text


def train_sentencepiece(texts: list[str], output_dir: Path, vocab_size: int) -> Path:
    import sentencepiece

    output_dir.mkdir(parents=True, exist_ok=True)
    prefix = output_dir / "tokenizer"
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
        # Llama's layout of the special pieces, and its byte fallback for characters never seen.
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, character_coverage=1.0,
        num_threads=1, seed_sentencepiece_size=100000, shuffle_input_sentence=False,
        max_sentence_length=1 << 20, minloglevel=2)
    prefix.with_suffix(".vocab").unlink(missing_ok=True)  # only the .model is read
    return prefix.with_suffix(".model")


def train_huggingface(texts: list[str], output_dir: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output_dir / "tokenizer.json"))
    (output_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False},
        indent=1) + "\n")
    return output_dir / "tokenizer.json"


def build_arg_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m trainer.data.train_tokenizer",
                           description="Train a small SentencePiece or Hugging Face tokenizer from JSONL, offline.")
    parser.add_argument("--kind", required=True, choices=("sentencepiece", "huggingface"))
    parser.add_argument("--input", type=Path, required=True, help="JSONL corpus (.jsonl, .jsonl.xz, .jsonl.gz)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--max-documents", type=int, default=None, help="read only the first N lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    if args.vocab_size < 300:  # SentencePiece's byte fallback alone takes 256 pieces
        print(f"error: --vocab-size={args.vocab_size} must be >= 300", file=sys.stderr)
        return 2
    if not args.input.is_file():
        print(f"error: input file not found: {args.input}", file=sys.stderr)
        return 1
    texts = list(corpus_texts(args.input, args.max_documents))
    if not texts:
        print(f"error: {args.input}: no text documents", file=sys.stderr)
        return 1
    train = train_sentencepiece if args.kind == "sentencepiece" else train_huggingface
    print(f"wrote {train(texts, args.output_dir, args.vocab_size)} from {len(texts)} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
