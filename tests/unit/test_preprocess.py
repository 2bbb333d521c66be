"""python -m trainer.preprocess: JSONL -> megatron-core indexed datasets, and its failure modes."""

from __future__ import annotations

import gzip
import json
import lzma
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from trainer.data import preprocess as preprocess_module
from trainer.data.preprocess import PreprocessConfig, PreprocessError, main, preprocess
from trainer.data.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
GPT2_VOCAB = REPO / "datasets" / "gpt2" / "vocab.json"
GPT2_MERGES = REPO / "datasets" / "gpt2" / "merges.txt"
BERT_VOCAB = REPO / "datasets" / "bert" / "vocab.txt"

DOCS = [
    "The quick brown fox jumps over the lazy dog.  Unicode survives: café, naïve, 東京.\n\nA new paragraph.",
    "Python is a programming language. It lets you work quickly. Integrate systems more effectively!",
    "Short one",
]


def _indexed_dataset(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


def _write_jsonl(path: Path, docs: list[str], compression: str = "") -> Path:
    data = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    compress = {"": lambda b: b, "xz": lzma.compress, "gz": gzip.compress}[compression]
    if compression:
        path = path.with_suffix(f"{path.suffix}.{compression}")
    path.write_bytes(compress(data))
    return path


def _gpt_args(src: Path, prefix: Path, *extra: str) -> list[str]:
    return ["--input", str(src), "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(GPT2_VOCAB), "--merge-file", str(GPT2_MERGES), *extra]


@pytest.mark.parametrize("compression", ["", "xz", "gz"])
def test_gpt_round_trip_text_to_indexed_dataset_and_back(tmp_path, compression):
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS, compression)
    assert main(_gpt_args(src, tmp_path / "out" / "gpt", "--append-eod")) == 0

    tokenizer = build_tokenizer("GPT2BPETokenizer", GPT2_VOCAB, GPT2_MERGES)
    dataset = _indexed_dataset(str(tmp_path / "out" / "gpt_text_document"))
    assert len(dataset) == len(DOCS)
    assert list(dataset.document_indices) == [0, 1, 2, 3]  # one sequence per document
    for doc, text in zip(dataset, DOCS, strict=True):
        assert doc[-1] == tokenizer.eod  # --append-eod
        assert tokenizer.detokenize(doc[:-1]) == text  # byte-level BPE is lossless
    assert str(dataset.index.dtype.__name__) == "uint16"  # Megatron's optimal dtype for an 8k vocab


def test_split_sentences_gives_one_sequence_per_sentence(tmp_path):
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    prefix = tmp_path / "bert"
    assert main(["--input", str(src), "--output-prefix", str(prefix), "--tokenizer-type",
                 "BertWordPieceLowerCase", "--vocab-file", str(BERT_VOCAB), "--split-sentences"]) == 0

    assert not (tmp_path / "bert_text_document.bin").exists()
    dataset = _indexed_dataset(str(tmp_path / "bert_text_sentence"))
    tokenizer = build_tokenizer("BertWordPieceLowerCase", BERT_VOCAB)
    bounds = list(dataset.document_indices)
    sentences_per_doc = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert sentences_per_doc == [3, 3, 1]
    second_doc = [tokenizer.detokenize(dataset[i]) for i in range(bounds[1], bounds[2])]
    assert second_doc == ["python is a programming language.", "it lets you work quickly.",
                          "integrate systems more effectively!"]


@pytest.mark.timeout(120)
def test_workers_keep_input_order(tmp_path, monkeypatch):
    # Chunks of 7 lines: 43 chunks through a window of 8 in flight, so results come back while
    # later chunks are still being handed out.
    monkeypatch.setattr(preprocess_module, "CHUNK_LINES", 7)
    docs = [f"Document number {i} says {'word ' * (i % 17)}and ends." for i in range(300)]
    src = _write_jsonl(tmp_path / "docs.jsonl", docs)
    for workers in (1, 2):
        assert main(_gpt_args(src, tmp_path / f"w{workers}", "--workers", str(workers))) == 0
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"w1_text_document{suffix}").read_bytes()
        two = (tmp_path / f"w2_text_document{suffix}").read_bytes()
        assert one == two, f"{suffix} differs between 1 and 2 workers"


@pytest.mark.timeout(120)
def test_an_encoding_worker_that_never_answers_fails_the_run_naming_its_lines(tmp_path, monkeypatch):
    # A zero time budget: the first chunk's result cannot be back (the workers are still loading the
    # tokenizer), which is what a worker that died or hung looks like to the parent.
    monkeypatch.setattr(preprocess_module, "CHUNK_TIMEOUT_BASE_S", 0.0)
    monkeypatch.setattr(preprocess_module, "CHUNK_TIMEOUT_BYTES_PER_S", 1e12)
    src = _write_jsonl(tmp_path / "docs.jsonl", [f"document {i}" for i in range(200)])
    config = PreprocessConfig(input=src, output_prefix=str(tmp_path / "out"), tokenizer_type="GPT2BPETokenizer",
                              vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES, workers=2)
    with pytest.raises(PreprocessError, match=rf"{src}: lines 1-64 not encoded within 0 s: an encoding worker"):
        preprocess(config)
    assert _leftovers(tmp_path, "out") == []
    # The pool's workers are gone (only the idle forkserver, which owns none, may remain).
    workers = [p for p in psutil.Process().children(recursive=True) if p.ppid() != psutil.Process().pid]
    assert psutil.wait_procs(workers, timeout=30)[1] == []


def _leftovers(directory: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefix))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_line_names_file_and_line_and_leaves_nothing(tmp_path, workers):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": "broken\n{"text": "never read"}\n')
    config = PreprocessConfig(input=src, output_prefix=str(tmp_path / "out"), tokenizer_type="GPT2BPETokenizer",
                              vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES, workers=workers)
    with pytest.raises(PreprocessError, match=rf"{src}:4: malformed JSON line"):
        preprocess(config)
    assert _leftovers(tmp_path, "out") == []


@pytest.mark.parametrize(
    ("line", "message"),
    [('{"body": "x"}', "no 'text' field"), ('{"text": 3}', "must be a string"), ("[1, 2]", "expected a JSON object")],
)
def test_wrong_record_shapes_are_named(tmp_path, line, message):
    src = tmp_path / "odd.jsonl"
    src.write_text('{"text": "ok"}\n' + line + "\n")
    config = PreprocessConfig(input=src, output_prefix=str(tmp_path / "out"), tokenizer_type="GPT2BPETokenizer",
                              vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)
    with pytest.raises(PreprocessError, match=f"{src}:2: .*{message}"):
        preprocess(config)
    assert _leftovers(tmp_path, "out") == []


@pytest.mark.timeout(240)  # a fresh interpreter importing torch + megatron-core: ~6 s idle, 35 s seen under load
def test_cli_malformed_line_is_one_line_exit_1(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{not json}\n')
    result = subprocess.run([sys.executable, "-m", "trainer.preprocess", *_gpt_args(src, tmp_path / "out")],
                            capture_output=True, text=True, cwd=REPO, timeout=200)
    assert result.returncode == 1
    assert result.stderr.strip().startswith(f"error: {src}:2: malformed JSON line"), result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert _leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("missing", ["vocab", "merge", "input"])
def test_missing_file_is_named(tmp_path, capsys, missing):
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    paths = {"vocab": GPT2_VOCAB, "merge": GPT2_MERGES, "input": src}
    paths[missing] = tmp_path / f"no-such-{missing}-file"
    args = ["--input", str(paths["input"]), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", str(paths["vocab"]), "--merge-file", str(paths["merge"])]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(paths[missing]) in err and len(err.splitlines()) == 1
    assert _leftovers(tmp_path, "out") == []


def test_config_names_every_bad_value(tmp_path):
    with pytest.raises(ValueError) as info:
        PreprocessConfig(input=tmp_path, output_prefix="", tokenizer_type="GPT2BPETokenizer",
                         vocab_file=GPT2_VOCAB, merge_file=None, workers=0, json_keys=("text", "text"))
    message = str(info.value)
    for expected in ("needs merge_file", "workers=0", "duplicates", "output_prefix"):
        assert expected in message, message


def test_several_json_keys_stay_aligned_and_empty_lines_are_skipped(tmp_path):
    src = tmp_path / "keys.jsonl"
    records = [{"text": "First body.", "title": "One"}, {"text": "", "title": ""},
               {"text": "Third body.", "title": ""}]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(_gpt_args(src, tmp_path / "k", "--json-keys", "text", "title")) == 0
    tokenizer = build_tokenizer("GPT2BPETokenizer", GPT2_VOCAB, GPT2_MERGES)
    texts, titles = (_indexed_dataset(str(tmp_path / f"k_{key}_document")) for key in ("text", "title"))
    # line 2 is empty in every key: skipped; line 3 has an empty title: an empty title document keeps alignment
    assert list(texts.document_indices) == [0, 1, 2] and list(titles.document_indices) == [0, 1, 1]
    assert [tokenizer.detokenize(d) for d in texts] == ["First body.", "Third body."]
    assert [tokenizer.detokenize(d) for d in titles] == ["One"]


# ---- inputs that cannot work fail here, naming the file -------------------------------------------
@pytest.mark.parametrize("content", ["", "\n\n   \n\t\n", '{"text": ""}\n\n{"text": ""}\n'],
                         ids=["empty", "blank-only", "empty-texts"])
def test_a_corpus_with_no_document_is_an_error_not_an_empty_dataset(tmp_path, capsys, content):
    src = tmp_path / "empty.jsonl"
    src.write_text(content)
    assert main(_gpt_args(src, tmp_path / "out")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {src}: no documents to write"), err
    assert len(err.splitlines()) == 1, err
    assert _leftovers(tmp_path, "out") == []  # no 0-document dataset for training to trip over later


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("compression", "workers"), [("xz", 1), ("xz", 2), ("gz", 1)])
def test_a_truncated_compressed_corpus_is_one_line_naming_the_file(tmp_path, capsys, compression, workers):
    docs = [f"Document {i}: " + "some words here " * 40 for i in range(200)]
    src = _write_jsonl(tmp_path / "docs.jsonl", docs, compression)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])  # a copy cut off half-way
    assert main(_gpt_args(src, tmp_path / "out", "--workers", str(workers))) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {src}: truncated or corrupt compressed input after line "), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert _leftovers(tmp_path, "out") == []


# ---- a write error leaves no temporary file behind ------------------------------------------------
def _limit_file_size() -> None:  # in the child: writes past 64 KiB fail with EFBIG, as on a full disk
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))


@pytest.mark.timeout(240)  # a fresh interpreter importing torch + megatron-core
def test_a_write_error_leaves_no_temporary_files_and_reports_the_write_error(tmp_path):
    src = REPO / "datasets" / "python-docs.jsonl.xz"  # MBs of tokens: the .bin outgrows the limit
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run([sys.executable, "-m", "trainer.preprocess", *_gpt_args(src, out / "gpt")],
                            capture_output=True, text=True, cwd=REPO, timeout=200, preexec_fn=_limit_file_size)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().startswith("error: [Errno 27] File too large"), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in out.iterdir()) == []  # no gpt_text_document.bin.tmp-<pid>


def test_megatron_lm_keep_newlines_keeps_the_newlines_that_end_sentences(tmp_path):
    src = _write_jsonl(tmp_path / "docs.jsonl", ["First sentence here.\nSecond one follows.  Third."])
    for flag, expected in (([], ["First sentence here.", "Second one follows.", "Third."]),
                           (["--keep-newlines"], ["First sentence here.\n", "Second one follows.  ", "Third."])):
        prefix = tmp_path / ("kept" if flag else "plain")
        assert main(_gpt_args(src, prefix, "--split-sentences", *flag)) == 0
        tokenizer = build_tokenizer("GPT2BPETokenizer", GPT2_VOCAB, GPT2_MERGES)
        dataset = _indexed_dataset(f"{prefix}_text_sentence")
        assert [tokenizer.detokenize(dataset[i]) for i in range(len(dataset))] == expected


def test_megatron_lm_partition_and_language_flags(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    assert main(_gpt_args(src, tmp_path / "one")) == 0
    assert main(_gpt_args(src, tmp_path / "parts", "--partitions", "2", "--keep-sequential-samples",
                          "--lang", "english")) == 0
    for suffix in (".bin", ".idx"):  # the same output as one partition
        assert (tmp_path / f"parts_text_document{suffix}").read_bytes() == \
            (tmp_path / f"one_text_document{suffix}").read_bytes()
    capsys.readouterr()
    assert main(_gpt_args(src, tmp_path / "x", "--partitions", "2", "--lang", "german", "--keep-newlines")) == 1
    err = capsys.readouterr().err
    assert "--keep-newlines) applies to --split-sentences only" in err
    assert "lang='german' (--lang): the shipped Punkt model is English" in err
    assert "partitions=2 (--partitions) without --keep-sequential-samples" in err
