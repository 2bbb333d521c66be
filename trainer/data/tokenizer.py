"""Tokenizers loaded from local vocabulary files only (no download, ever).

Megatron-Core's own GPT-2 / BERT tokenizer wrappers fetch vocabularies from the internet; HF
``tokenizers`` (Rust) reads the same vocab.json + merges.txt / vocab.txt files offline and is fast
enough to tokenize the sample corpus in seconds. The interface follows Megatron's tokenizers
(``vocab_size``, ``tokenize``, ``detokenize``, ``eod``, ``pad``, ``cls``, ``sep``, ``mask``), so
the rest of the trainer does not care which library is underneath.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from trainer.names import FILE_TOKENIZERS, MODEL_FILE_TOKENIZERS

GPT2_EOD = "<|endoftext|>"
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class TextTokenizer(Protocol):
    """What preprocessing and the datasets need from a tokenizer."""

    name: str
    vocab_size: int
    eod: int
    pad: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


def _require_file(path: str | Path | None, what: str, tokenizer_type: str) -> Path:
    if path is None:
        raise ValueError(f"{tokenizer_type} needs a {what} (got none)")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from vocab.json + merges.txt; ``<|endoftext|>`` ends every document."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | Path, merge_file: str | Path) -> None:
        vocab_path = _require_file(vocab_file, "vocab file", self.name)
        merge_path = _require_file(merge_file, "merge file", self.name)
        try:
            model = models.BPE.from_file(str(vocab_path), str(merge_path))
        except Exception as exc:  # the Rust error does not say which file was bad
            raise ValueError(f"cannot read GPT-2 BPE files {vocab_path} / {merge_path}: {exc}") from exc
        self._tokenizer = Tokenizer(model)
        # GPT-2's own settings: no prefix space, GPT-2's split regex, bytes mapped to printable chars.
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        eod = self._tokenizer.token_to_id(GPT2_EOD)
        if eod is None:
            raise ValueError(f"vocab file {vocab_path} has no {GPT2_EOD} token")
        self.eod = eod
        # GPT-2 has no padding token; Megatron pads GPT batches with EOD too, and masks them out of the loss.
        self.pad = eod
        self.vocab_size = self._tokenizer.get_vocab_size()

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class BertWordPieceLowerCase:
    """Uncased BERT WordPiece from vocab.txt; ``tokenize`` adds no [CLS]/[SEP] (the dataset does)."""

    name = "BertWordPieceLowerCase"
    lowercase = True
    """Lowercase and strip accents, as Megatron-LM's BERT tokenizer with do_lower_case."""

    def __init__(self, vocab_file: str | Path) -> None:
        vocab_path = _require_file(vocab_file, "vocab file", self.name)
        vocab = _read_wordpiece_vocab(vocab_path)
        missing = [t for t in BERT_SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"vocab file {vocab_path} lacks the special tokens {missing}")
        self._tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        self._tokenizer.normalizer = normalizers.BertNormalizer(lowercase=self.lowercase, strip_accents=self.lowercase)
        self._tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tokenizer.decoder = decoders.WordPiece(prefix="##")
        self.vocab_size = len(vocab)
        self.pad, self.unk, self.cls, self.sep, self.mask = (vocab[t] for t in BERT_SPECIAL_TOKENS)
        # BERT has no end-of-document token; Megatron's BERT tokenizer uses [SEP] for it.
        self.eod = self.sep
        self.special_ids = frozenset((self.pad, self.unk, self.cls, self.sep, self.mask))
        self.inv_vocab = {i: t for t, i in vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class BertWordPieceCase(BertWordPieceLowerCase):
    """Cased BERT WordPiece: case and accents kept (Megatron-LM strips accents only when lowercasing)."""

    name = "BertWordPieceCase"
    lowercase = False


def _read_wordpiece_vocab(path: Path) -> dict[str, int]:
    tokens = path.read_text(encoding="utf-8").splitlines()
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"vocab file {path} has duplicate tokens")
    return vocab


class Llama2Tokenizer:
    """Megatron-LM's ``Llama2Tokenizer``: a SentencePiece model (``--tokenizer-model tokenizer.model``).

    As Megatron-LM's wrapper: ``tokenize`` is SentencePiece's ids with BOS in front (per call, so per
    sentence with --split-sentences), no EOS; the end-of-document token (--append-eod, and what the
    GPT dataset masks) is the model's EOS; the vocabulary is the model's pieces, extra ids none.
    """

    name = "Llama2Tokenizer"

    def __init__(self, tokenizer_model: str | Path) -> None:
        path = _require_file(tokenizer_model, "tokenizer model (--tokenizer-model)", self.name)
        try:
            import sentencepiece
        except ImportError as exc:  # a dependency of the project; named if an environment lacks it
            raise ValueError(f"{self.name} needs the sentencepiece package (pip install sentencepiece)") from exc
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"cannot read SentencePiece model {path}: {exc}") from exc
        self._processor = processor
        self.vocab_size = processor.get_piece_size()
        self.bos, self.eod, self.pad = processor.bos_id(), processor.eos_id(), processor.pad_id()
        if self.bos < 0 or self.eod < 0:
            raise ValueError(f"SentencePiece model {path} has no BOS/EOS piece (bos_id {self.bos}, eos_id "
                             f"{self.eod}); Llama2Tokenizer puts BOS before every text and uses EOS as end of document")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self._processor.encode(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._processor.decode_ids([int(i) for i in ids])


class HuggingFaceTokenizer:
    """Megatron-LM's ``HuggingFaceTokenizer`` read offline from a local tokenizer (``--tokenizer-model``
    a folder holding tokenizer.json, or that file).

    Megatron-LM loads it with transformers' AutoTokenizer; its ids are the fast tokenizer's, i.e. the
    ``tokenizers`` library's encoding *with* the tokenizer's own special tokens (its post-processor,
    e.g. Llama's BOS): that is what this runs, without transformers. The end-of-document token is the
    tokenizer's ``eos_token`` (tokenizer_config.json or special_tokens_map.json beside tokenizer.json),
    the vocabulary size ``len(tokenizer)`` (added tokens included), as there.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: str | Path) -> None:
        if tokenizer_model is None:
            raise ValueError(f"{self.name} needs a tokenizer model (--tokenizer-model, a folder or tokenizer.json)")
        path = Path(tokenizer_model)
        folder, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {file} (--tokenizer-model {tokenizer_model}; "
                                    "only local fast tokenizers are read, nothing is downloaded)")
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust error does not say which file was bad
            raise ValueError(f"cannot read Hugging Face tokenizer {file}: {exc}") from exc
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eos = _special_token(folder, "eos_token")
        eod = None if eos is None else self._tokenizer.token_to_id(eos)
        if eod is None:
            raise ValueError(f"Hugging Face tokenizer {folder}: no eos_token in tokenizer_config.json or "
                             f"special_tokens_map.json (found {eos!r}); Megatron-LM's end of document is that token")
        self.eod = eod
        pad = _special_token(folder, "pad_token")
        pad_id = None if pad is None else self._tokenizer.token_to_id(pad)
        self.pad = eod if pad_id is None else pad_id

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _special_token(folder: Path, key: str) -> str | None:
    """``key`` (e.g. eos_token) as transformers reads it: tokenizer_config.json, else special_tokens_map.json;
    a value is a string or an AddedToken dict with its ``content``."""
    import json

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = folder / name
        if not config.is_file():
            continue
        try:
            value = json.loads(config.read_text(encoding="utf-8")).get(key)
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{config}: not a JSON object ({exc})") from None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def build_tokenizer(
    tokenizer_type: str, vocab_file: str | Path | None, merge_file: str | Path | None = None,
    tokenizer_model: str | Path | None = None,
) -> GPT2BPETokenizer | BertWordPieceLowerCase | Llama2Tokenizer | HuggingFaceTokenizer:
    """The tokenizer named like Megatron-LM's ``--tokenizer-type``, from local files only."""
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "BertWordPieceLowerCase":
        return BertWordPieceLowerCase(vocab_file)
    if tokenizer_type == "BertWordPieceCase":
        return BertWordPieceCase(vocab_file)
    raise ValueError(f"tokenizer_type={tokenizer_type!r} is not one of {list(FILE_TOKENIZERS + MODEL_FILE_TOKENIZERS)}")

