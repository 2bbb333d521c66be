"""JSONL text -> Megatron-Core indexed dataset (.bin/.idx), like Megatron-LM's tools/preprocess_data.py.

Output names follow Megatron-LM exactly: ``{prefix}_{json_key}_document.{bin,idx}``, or
``..._sentence.{bin,idx}`` with ``--split-sentences`` (one indexed sequence per sentence, sentences
grouped into documents). The files are written by megatron-core's own ``IndexedDatasetBuilder`` and so
are readable by its ``IndexedDataset``.

Unlike Megatron-LM's tool, a bad input never leaves half-written outputs: everything goes to temporary
names that are renamed only after the last document, and removed on any error. Documents that
tokenize to nothing are skipped (Megatron-LM writes them as empty documents, which samplers must
then step around); an input with no document left is an error, not an empty dataset that would only
fail later in training. A truncated or corrupt ``.xz``/``.gz`` is an error naming the file.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import itertools
import json
import logging
import lzma
import multiprocessing
import os
import signal
import sys
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from trainer.cli import OneLineParser
from trainer.data.sentence_splitter import DEFAULT_PUNKT_PARAMS, load_sentence_splitter
from trainer.data.tokenizer import build_tokenizer
from trainer.names import FILE_TOKENIZERS, MODEL_FILE_TOKENIZERS
from trainer.problems import raise_if_any

log = logging.getLogger(__name__)


class PreprocessError(ValueError):
    """Bad input data; the message names the file and line (``path:line: what``)."""


@dataclass(frozen=True)
class PreprocessConfig:
    """One preprocessing run (the flags of ``python -m trainer.preprocess``)."""

    input: Path
    """JSONL file, one document per line (``.jsonl``, ``.jsonl.xz`` or ``.jsonl.gz``)."""
    output_prefix: str
    """Outputs are ``{output_prefix}_{key}_{document|sentence}.{bin,idx}``."""
    tokenizer_type: str
    """A file tokenizer of trainer/names.py (Megatron-LM's ``--tokenizer-type`` names)."""
    vocab_file: Path | None
    """vocab.json (GPT-2 BPE) or vocab.txt (WordPiece); None for the --tokenizer-model tokenizers."""
    merge_file: Path | None = None
    """merges.txt; required by GPT2BPETokenizer."""
    json_keys: tuple[str, ...] = ("text",)
    """JSON fields to tokenize; each key gets its own output pair."""
    append_eod: bool = False
    """Append the end-of-document token to every document (GPT pretraining)."""
    split_sentences: bool = False
    """Split documents into sentences with the shipped Punkt model (BERT pretraining)."""
    punkt_model: Path = DEFAULT_PUNKT_PARAMS
    """Punkt parameter file used by ``split_sentences``."""
    workers: int = 1
    """Tokenizer processes; results are written in input order whatever the worker count."""
    log_interval: int = 10000
    """Log progress every this many documents."""
    tokenizer_model: Path | None = None
    """tokenizer.model (Llama2Tokenizer) or a Hugging Face tokenizer folder / tokenizer.json
    (HuggingFaceTokenizer), Megatron-LM's ``--tokenizer-model``."""
    keep_newlines: bool = False
    """With split_sentences: keep the newlines that end sentences (Megatron-LM's ``--keep-newlines``)."""
    lang: str = "english"
    """Punkt's language (Megatron-LM's ``--lang``): the shipped model is English; another language
    needs its own --punkt-model."""
    partitions: int = 1
    """Megatron-LM's ``--partitions``: it splits the input into N files, tokenizes them in parallel and
    merges them in order. With --keep-sequential-samples the output is the same as one partition's
    (documents in input order), which --workers already parallelises; without, Megatron-LM would
    deal the lines round-robin, which is refused rather than reordered silently."""
    keep_sequential_samples: bool = False
    """Megatron-LM's ``--keep-sequential-samples``: partitions hold consecutive lines (input order kept)."""

    def __post_init__(self) -> None:
        problems = []
        if self.tokenizer_type not in FILE_TOKENIZERS + MODEL_FILE_TOKENIZERS:
            problems.append(f"tokenizer_type={self.tokenizer_type!r} is not one of "
                            f"{list(FILE_TOKENIZERS + MODEL_FILE_TOKENIZERS)}")
        if self.tokenizer_type in MODEL_FILE_TOKENIZERS and self.tokenizer_model is None:
            problems.append(f"tokenizer_type={self.tokenizer_type!r} needs tokenizer_model (--tokenizer-model)")
        if self.tokenizer_type in FILE_TOKENIZERS and self.vocab_file is None:
            problems.append(f"tokenizer_type={self.tokenizer_type!r} needs vocab_file (--vocab-file)")
        if self.tokenizer_type == "GPT2BPETokenizer" and self.merge_file is None:
            problems.append("tokenizer_type='GPT2BPETokenizer' needs merge_file (--merge-file)")
        if not self.json_keys or any(not k for k in self.json_keys):
            problems.append(f"json_keys={list(self.json_keys)} must be non-empty names")
        if len(set(self.json_keys)) != len(self.json_keys):
            problems.append(f"json_keys={list(self.json_keys)} has duplicates")
        if self.workers < 1:
            problems.append(f"workers={self.workers} must be >= 1")
        if self.keep_newlines and not self.split_sentences:
            problems.append("keep_newlines (--keep-newlines) applies to --split-sentences only")
        if self.lang != "english" and Path(self.punkt_model) == DEFAULT_PUNKT_PARAMS:
            problems.append(f"lang={self.lang!r} (--lang): the shipped Punkt model is English; give that language's "
                            "parameters with --punkt-model")
        if self.partitions < 1:
            problems.append(f"partitions={self.partitions} must be >= 1")
        elif self.partitions > 1 and not self.keep_sequential_samples:
            problems.append(f"partitions={self.partitions} (--partitions) without --keep-sequential-samples would deal "
                            "the documents round-robin over the partitions (Megatron-LM's order); pass "
                            "--keep-sequential-samples for input order (--workers spreads the work)")
        if self.log_interval < 1:
            problems.append(f"log_interval={self.log_interval} must be >= 1")
        if not self.output_prefix:
            problems.append("output_prefix must not be empty")
        raise_if_any(problems, "invalid preprocessing config")

    @property
    def output_paths(self) -> dict[str, tuple[str, str]]:
        """Per JSON key, the (.bin, .idx) paths, named exactly as Megatron-LM's preprocess_data.py does."""
        level = "sentence" if self.split_sentences else "document"
        return {key: (f"{self.output_prefix}_{key}_{level}.bin", f"{self.output_prefix}_{key}_{level}.idx")
                for key in self.json_keys}

    def check_files(self) -> None:
        """FileNotFoundError naming the first missing input file (before any output is created)."""
        needed = [("input file", self.input)]
        if self.vocab_file is not None:
            needed.append(("vocab file", self.vocab_file))
        if self.tokenizer_model is not None and self.tokenizer_type == "Llama2Tokenizer":
            needed.append(("tokenizer model", self.tokenizer_model))
        elif self.tokenizer_model is not None and not Path(self.tokenizer_model).exists():
            raise FileNotFoundError(f"tokenizer model not found: {self.tokenizer_model}")
        if self.merge_file is not None:
            needed.append(("merge file", self.merge_file))
        if self.split_sentences:
            needed.append(("Punkt sentence model", self.punkt_model))
        for what, path in needed:
            if not Path(path).exists():
                raise FileNotFoundError(f"{what} not found: {path}")
            if not Path(path).is_file():
                raise FileNotFoundError(f"{what} is not a file: {path}")


@dataclass
class EncodedDocument:
    """Token ids of one input line, per JSON key: (ids, lengths of its sentences)."""

    line_number: int
    sequences: dict[str, tuple[np.ndarray, list[int]]]
    input_bytes: int


class DocumentEncoder:
    """Tokenizes one JSONL line; built once per worker process (tokenizers do not pickle cheaply)."""

    def __init__(self, config: PreprocessConfig) -> None:
        self.config = config
        self.tokenizer = build_tokenizer(config.tokenizer_type, config.vocab_file, config.merge_file,
                                         config.tokenizer_model)
        self.splitter = (load_sentence_splitter(config.punkt_model, config.keep_newlines)
                         if config.split_sentences else None)

    def encode(self, numbered_line: tuple[int, bytes]) -> EncodedDocument:
        line_number, raw = numbered_line
        where = f"{self.config.input}:{line_number}"
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PreprocessError(f"{where}: malformed JSON line: {exc}") from None
        if not isinstance(record, dict):
            raise PreprocessError(f"{where}: expected a JSON object, got {type(record).__name__}")
        return EncodedDocument(
            line_number, {key: self._encode_field(record, key, where) for key in self.config.json_keys},
            len(raw),
        )

    def _encode_field(self, record: dict, key: str, where: str) -> tuple[np.ndarray, list[int]]:
        if key not in record:
            raise PreprocessError(f"{where}: no {key!r} field (fields: {sorted(record)})")
        text = record[key]
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            sentences = text  # already split, as Megatron-LM accepts
        elif isinstance(text, str):
            sentences = self.splitter.tokenize(text) if self.splitter else [text]
        else:
            raise PreprocessError(f"{where}: field {key!r} must be a string or a list of strings")
        ids: list[int] = []
        lengths: list[int] = []
        for sentence in sentences:
            sentence_ids = self.tokenizer.tokenize(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and self.config.append_eod:
            ids.append(self.tokenizer.eod)
            lengths[-1] += 1
        return np.asarray(ids, dtype=np.int64), lengths


class _WorkerEncoder:
    """The worker process's encoder. The Pool initializer builds it once per process; it lives in a
    class attribute of the worker's copy of this class, never set in the parent process."""

    encoder: DocumentEncoder | None = None

    @classmethod
    def init(cls, config: PreprocessConfig) -> None:
        cls.encoder = DocumentEncoder(config)

    @classmethod
    def encode(cls, numbered_line: tuple[int, bytes]) -> EncodedDocument:
        assert cls.encoder is not None, "worker used before its initializer ran"
        return cls.encoder.encode(numbered_line)


def _open_input(path: Path) -> IO[bytes]:
    if path.suffix == ".xz":
        return lzma.open(path, "rb")
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


# What a truncated or corrupt compressed input raises while it is read (BadGzipFile is an OSError).
_DECOMPRESSION_ERRORS = (EOFError, lzma.LZMAError, zlib.error, gzip.BadGzipFile)


def _numbered_lines(handle: IO[bytes], path: Path) -> Iterator[tuple[int, bytes]]:
    # Raw bytes: UTF-8 decoding happens in the worker, so a bad byte is reported with its line number.
    number = 0
    try:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():  # blank lines (a trailing newline, say) are not documents
                yield number, raw
    except _DECOMPRESSION_ERRORS as exc:
        # The file ended (or broke) mid-stream: name it, and how far it got, instead of a traceback.
        raise PreprocessError(
            f"{path}: truncated or corrupt compressed input after line {number}: {exc or type(exc).__name__}"
        ) from None


class _AtomicIndexedDatasetWriter:
    """megatron-core's IndexedDatasetBuilder writing to temporary names, renamed by ``commit``."""

    def __init__(self, bin_path: str, idx_path: str, vocab_size: int) -> None:
        with warnings.catch_warnings():  # megatron-core warns about missing TE/Apex on import
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
        suffix = f".tmp-{os.getpid()}"
        self.final = (bin_path, idx_path)
        self.temporary = (bin_path + suffix, idx_path + suffix)
        self.builder = IndexedDatasetBuilder(self.temporary[0], dtype=DType.optimal_dtype(vocab_size))

    def add_document(self, ids: np.ndarray, lengths: list[int]) -> None:
        self.builder.add_document(ids, lengths)

    def commit(self) -> None:
        self.builder.finalize(self.temporary[1])
        # .bin first: IndexedDataset.exists() looks for the .idx, so a reader never sees a lone .idx
        for temporary, final in zip(self.temporary, self.final, strict=True):
            os.replace(temporary, final)

    def abort(self) -> None:
        """Remove the temporary files; never raises, so the error that caused the abort is the one seen.

        Closing flushes the builder's buffer, which fails again the way the write did (a full disk,
        a file size limit): that second error is dropped, and the files are removed regardless.
        """
        with contextlib.suppress(OSError, ValueError):
            self.builder.data_file.close()
        for temporary in self.temporary:
            with contextlib.suppress(OSError):
                Path(temporary).unlink(missing_ok=True)


@dataclass
class PreprocessStats:
    """What a run wrote (the CLI prints it)."""

    documents: int = 0
    """Documents written (per JSON key)."""
    skipped_empty: int = 0
    """Input lines whose every key tokenized to nothing."""
    sequences: int = 0
    """Indexed sequences written over all keys: documents, or sentences with --split-sentences."""
    tokens: int = 0
    """Tokens written over all keys, EOD tokens included."""
    input_bytes: int = 0
    """Bytes of (decompressed) input read."""
    seconds: float = 0.0
    """Wall time of tokenizing and writing, excluding the one-off megatron-core import."""


# Lines per task sent to a worker, and tasks in flight per worker: enough to keep every worker busy,
# few enough that the parent's memory stays bounded however long the corpus is.
CHUNK_LINES = 64
CHUNKS_IN_FLIGHT_PER_WORKER = 4
# A chunk's result must come back within this many seconds plus one second per 50 kB of its input (a
# very slow tokenizer's pace): a worker that died or hung fails the run naming its lines instead of
# holding the job until its Slurm time limit.
CHUNK_TIMEOUT_BASE_S = 600.0
CHUNK_TIMEOUT_BYTES_PER_S = 50_000


def _encode_chunk(chunk: list[tuple[int, bytes]]) -> list[EncodedDocument]:
    return [_WorkerEncoder.encode(line) for line in chunk]


def _chunks(lines: Iterable[tuple[int, bytes]], size: int) -> Iterator[list[tuple[int, bytes]]]:
    chunk: list[tuple[int, bytes]] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def chunk_timeout_s(chunk: list[tuple[int, bytes]]) -> float:
    return CHUNK_TIMEOUT_BASE_S + sum(len(raw) for _, raw in chunk) / CHUNK_TIMEOUT_BYTES_PER_S


def _encoded_documents(config: PreprocessConfig, lines: Iterable[tuple[int, bytes]]) -> Iterator[EncodedDocument]:
    if config.workers == 1:
        encoder = DocumentEncoder(config)
        yield from map(encoder.encode, lines)
        return
    # forkserver, not fork: the workers come from a small single-threaded server process, never from
    # this one, whose native threads (the BLAS pool, the Rust tokenizer's) may hold a lock at the
    # moment of a fork and leave the child waiting on it forever. The server imports this module
    # once, so a worker starts without re-importing it (spawn would pay that per worker).
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload([__name__])
    in_flight: collections.deque = collections.deque()
    # The with-block terminates the workers on the way out, a hung one included.
    with context.Pool(config.workers, initializer=_WorkerEncoder.init, initargs=(config,)) as pool:
        chunks = _chunks(lines, CHUNK_LINES)
        for chunk in itertools.islice(chunks, config.workers * CHUNKS_IN_FLIGHT_PER_WORKER):
            in_flight.append((chunk, pool.apply_async(_encode_chunk, (chunk,))))
        while in_flight:
            chunk, pending = in_flight.popleft()
            timeout_s = chunk_timeout_s(chunk)
            try:
                documents = pending.get(timeout=timeout_s)
            except multiprocessing.TimeoutError:
                raise PreprocessError(
                    f"{config.input}: lines {chunk[0][0]}-{chunk[-1][0]} not encoded within {timeout_s:.0f} s: "
                    f"an encoding worker died or hung (of {config.workers}; --workers 1 encodes in this process)"
                ) from None
            following = next(chunks, None)  # input order: the next chunk goes in as this one comes out
            if following is not None:
                in_flight.append((following, pool.apply_async(_encode_chunk, (following,))))
            yield from documents


def preprocess(config: PreprocessConfig) -> PreprocessStats:
    """Tokenize ``config.input`` into indexed datasets; nothing is left behind if it fails."""
    config.check_files()
    vocab_size = build_tokenizer(config.tokenizer_type, config.vocab_file, config.merge_file,
                                 config.tokenizer_model).vocab_size
    Path(config.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    stats = PreprocessStats()
    writers: dict[str, _AtomicIndexedDatasetWriter] = {}
    try:
        for key, (bin_path, idx_path) in config.output_paths.items():
            writers[key] = _AtomicIndexedDatasetWriter(bin_path, idx_path, vocab_size)
        start = time.perf_counter()  # after the (slow, one-off) megatron-core import in the writer
        with _open_input(config.input) as handle:
            for doc in _encoded_documents(config, _numbered_lines(handle, config.input)):
                _write_document(doc, writers, stats)
                if stats.documents and stats.documents % config.log_interval == 0:
                    # Megatron-LM's progress line: documents/s and MB/s (MiB, as it divides by 1024^2).
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    log.info("Processed %d documents (%.1f docs/s, %.2f MB/s).", stats.documents,
                             stats.documents / elapsed, stats.input_bytes / elapsed / 1024 / 1024)
        if stats.documents == 0:
            # A 0-document dataset "succeeds" here and fails only once training has its nodes.
            raise PreprocessError(
                f"{config.input}: no documents to write: the file is empty or blank-only, or every line's"
                f" {'/'.join(config.json_keys)} tokenized to nothing ({stats.skipped_empty} such lines)"
            )
        for writer in writers.values():
            writer.commit()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    stats.seconds = time.perf_counter() - start
    return stats


def _write_document(doc: EncodedDocument, writers: dict[str, _AtomicIndexedDatasetWriter],
                    stats: PreprocessStats) -> None:
    stats.input_bytes += doc.input_bytes
    if all(not lengths for _, lengths in doc.sequences.values()):
        stats.skipped_empty += 1
        return
    # A key that is empty in this line still gets its (empty) document: document i of every output
    # comes from the same input line, so multi-key outputs stay aligned.
    for key, (ids, lengths) in doc.sequences.items():
        writers[key].add_document(ids, lengths)
        stats.sequences += len(lengths)
        stats.tokens += int(ids.size)
    stats.documents += 1


def build_arg_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m trainer.preprocess",
        description="Tokenize a JSONL corpus into Megatron-Core indexed datasets (.bin/.idx), offline.",
    )
    parser.add_argument("--input", type=Path, required=True, help="JSONL file (.jsonl, .jsonl.xz, .jsonl.gz)")
    parser.add_argument("--output-prefix", required=True, help="output path prefix")
    parser.add_argument("--tokenizer-type", required=True, choices=FILE_TOKENIZERS + MODEL_FILE_TOKENIZERS)
    parser.add_argument("--vocab-file", type=Path, default=None, help="vocab.json / vocab.txt (file tokenizers)")
    parser.add_argument("--merge-file", type=Path, default=None)
    parser.add_argument("--tokenizer-model", type=Path, default=None,
                        help="Llama2Tokenizer: tokenizer.model; HuggingFaceTokenizer: a local folder or tokenizer.json")
    parser.add_argument("--json-keys", "--json-key", nargs="+", default=["text"], dest="json_keys",
                        help="JSON fields to tokenize (default: text)")
    parser.add_argument("--append-eod", action="store_true", help="append end-of-document token")
    parser.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (Punkt)")
    parser.add_argument("--punkt-model", type=Path, default=DEFAULT_PUNKT_PARAMS,
                        help="Punkt parameters JSON (default: the shipped datasets/punkt/english.json)")
    parser.add_argument("--keep-newlines", action="store_true",
                        help="with --split-sentences: keep the newlines between sentences (Megatron-LM's)")
    parser.add_argument("--lang", default="english", help="Punkt language (the shipped model is English)")
    parser.add_argument("--partitions", type=int, default=1,
                        help="Megatron-LM's input partitions: with --keep-sequential-samples the same output")
    parser.add_argument("--keep-sequential-samples", action="store_true",
                        help="partitions keep the input order (Megatron-LM's)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10000)
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    return PreprocessConfig(
        input=args.input, output_prefix=args.output_prefix, tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file, merge_file=args.merge_file, json_keys=tuple(args.json_keys),
        append_eod=args.append_eod, split_sentences=args.split_sentences, punkt_model=args.punkt_model,
        workers=args.workers, log_interval=args.log_interval, tokenizer_model=args.tokenizer_model,
        keep_newlines=args.keep_newlines, lang=args.lang, partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples,
    )


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived (Slurm cancelling or requeueing the job, a closed terminal)."""


def _stop_on_termination() -> None:
    """Turn SIGTERM/SIGHUP into :class:`Terminated` in this (the main) process, so that :func:`preprocess`
    removes its ``*.tmp-<pid>`` files on the way out as it does on any error; their default action
    ended the process on the spot and left them (Slurm's ``scancel`` sends TERM, then KILL KillWait
    later). An encoding worker comes from the forkserver without this handler and ends on TERM by
    default; the pool is torn down by the main process."""
    main_pid = os.getpid()

    def stop(signum: int, frame: object) -> None:
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        raise Terminated(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: prints a summary table. A bad flag -> the parser's one line on stderr, exit code 2;
    bad input (files, values) -> one ``error:`` line on stderr, exit code 1."""
    args = build_arg_parser().parse_args(argv)
    _stop_on_termination()
    # INFO for our own progress lines only; megatron-core logs chatter about FSDP/TE at import time.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("trainer").setLevel(logging.INFO)
    try:
        config = config_from_args(args)
        stats = preprocess(config)
    except (PreprocessError, ValueError, OSError) as exc:  # OSError: missing/unreadable/unwritable paths
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for key, (bin_path, idx_path) in config.output_paths.items():
        print(f"{key}: wrote {bin_path} and {idx_path}")
    print(f"documents {stats.documents} (skipped empty: {stats.skipped_empty}) | sequences {stats.sequences}"
          f" | tokens {stats.tokens} | {stats.input_bytes / 1e6:.1f} MB in {stats.seconds:.1f} s"
          f" ({stats.input_bytes / 1e6 / max(stats.seconds, 1e-9):.2f} MB/s, {config.workers} workers)")
    return 0
