"""Inputs that used to fail with errors naming no file: a damaged .idx, a .bin holding token ids
past the vocabulary, preprocessing stopped by SIGTERM, and trace files only their owner could read."""

from __future__ import annotations

import gc
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from trainer.data.indexed import check_token_ids, open_indexed_dataset
from trainer.profiling.tracer import write_json_atomic

REPO = Path(__file__).resolve().parents[2]


def _write_indexed(prefix: Path, documents: list[list[int]], dtype=np.uint16) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        builder.add_document(np.array(doc, dtype=dtype), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.mark.parametrize("cut", [10, 40])
def test_a_cut_off_index_is_named(tmp_path, cut, monkeypatch):
    prefix = _write_indexed(tmp_path / "data", [[1, 2, 3], [4, 5]])
    idx = Path(prefix + ".idx")
    idx.write_bytes(idx.read_bytes()[:cut])  # a copy cut off: megatron-core said "buffer is smaller than ..."
    ignored = []  # "Exception ignored in ...": megatron-core's __del__ on the half-built dataset, once
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    with pytest.raises(ValueError, match=rf"indexed dataset index {prefix}\.idx is damaged or not a megatron-core "
                                         "index .*re-run python -m trainer.preprocess"):
        open_indexed_dataset(prefix)
    gc.collect()
    assert not ignored, [f"{u.exc_type.__name__}: {u.exc_value} in {u.object}" for u in ignored]


def test_a_foreign_index_is_named(tmp_path):
    prefix = _write_indexed(tmp_path / "data", [[1, 2, 3]])
    Path(prefix + ".idx").write_bytes(b"not an index at all, but long enough to have a header" * 4)
    with pytest.raises(ValueError, match=rf"{prefix}\.idx is damaged or not a megatron-core index"):
        open_indexed_dataset(prefix)


def test_token_ids_past_the_vocabulary_name_the_file_the_id_and_the_vocabulary(tmp_path):
    prefix = _write_indexed(tmp_path / "data", [[1, 2, 3], [4, 60000, 5], [7]])
    open_indexed_dataset(prefix)  # no vocabulary given: not checked
    open_indexed_dataset(prefix, vocab_size=60001)  # every id fits
    with pytest.raises(ValueError) as err:
        open_indexed_dataset(prefix, vocab_size=50257)
    assert str(err.value).startswith(f"indexed dataset {prefix}.bin holds token id 60000 (token 4, sequence 1) but "
                                     "the vocabulary has 50257 ids")


def test_the_check_reads_past_one_block(tmp_path, monkeypatch):
    import trainer.data.indexed as indexed

    monkeypatch.setattr(indexed, "_SCAN_TOKENS", 4)
    prefix = _write_indexed(tmp_path / "data", [[1] * 9, [2, 3, 99]])
    dataset = open_indexed_dataset(prefix)
    with pytest.raises(ValueError, match=r"holds token id 99 \(token 11, sequence 1\)"):
        check_token_ids(prefix, dataset.index, 50)
    check_token_ids(prefix, dataset.index, 100)


def test_a_dtype_that_cannot_hold_such_ids_is_not_read(tmp_path, monkeypatch):
    prefix = _write_indexed(tmp_path / "data", [[1, 2, 3]], dtype=np.uint16)
    dataset = open_indexed_dataset(prefix)
    monkeypatch.setattr(np, "memmap", None)  # would fail if the file were read
    check_token_ids(prefix, dataset.index, 70000)


def test_a_bad_dataset_is_refused_by_the_dataset_builder_before_training(tmp_path):
    """The path training takes: megatron-core's builder (trainer.data.megatron_datasets) with the GPT-2
    tokenizer's 50257 ids over a dataset written with a larger vocabulary."""
    from trainer.data.megatron_datasets import SplitSizes, gpt_samples, parse_blend

    prefix = _write_indexed(tmp_path / "data", [list(range(100, 200)), [50300] * 100])
    blend = parse_blend([prefix])[0]
    with pytest.raises(ValueError, match=rf"{prefix}\.bin holds token id 50300 .* the vocabulary has 50257 ids"):
        gpt_samples(blend, "1,0,0", 16, 1234, SplitSizes(8, 0), "GPT2BPETokenizer", 50257, 50256,
                    str(tmp_path / "cache"))


def test_sigterm_to_preprocessing_leaves_no_temporary_files(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    line = json.dumps({"text": "A sentence of some length that takes the tokenizer a moment. " * 20}) + "\n"
    corpus.write_text(line * 20000)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.preprocess", "--input", str(corpus), "--output-prefix",
                             str(out / "sample"), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                             "datasets/gpt2/vocab.json", "--merge-file", "datasets/gpt2/merges.txt", "--log-interval",
                             "100"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("*.tmp-*")):  # writing has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert sorted(p.name for p in out.iterdir()) == [], err


def test_traces_and_summaries_get_the_run_folders_mode(tmp_path):
    previous = os.umask(0o027)  # a group-shared run folder
    try:
        write_json_atomic(tmp_path / "summary.json", {"a": 1})
        (tmp_path / "other.txt").write_text("x")  # any other file of the run
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "summary.json").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "other.txt").stat().st_mode) == 0o640
