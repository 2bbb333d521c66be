"""Shared fixtures: no leaked shared-memory segments of this test run, GPU tests skipped without CUDA, the
shipped corpus cut and tokenized once per test run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.corpus import preprocess_gpt2, small_corpus
from tests.shm_tag import TAG, our_segments
from trainer.launch.run_token import RUN_TAG_ENV

REPO = Path(__file__).resolve().parents[1]
LEAK_GRACE_S = 3.0
CORPUS_SLICE_DOCUMENTS = 150  # 390 KB of text: 50 x 8 samples of 32 tokens without repeating, seconds to tokenize

# Before any test, forked rank or launched rank exists: every run token drawn from here on (this
# process and everything it starts inherits the environment) begins with this run's tag.
os.environ[RUN_TAG_ENV] = TAG


@pytest.fixture(autouse=True)
def no_leaked_shared_memory():
    """Every test must leave /dev/shm as it found it -- as far as this test run's own segments go.

    Only names carrying this run's tag are looked at (tests/shm_tag.py): the whole of /dev/shm is
    anyone's, and another run on the host (a second clone's tests, a training job) must never fail
    a test here, nor could a test here tell that run's segments from a leak of its own. Tests run
    one at a time in this process, so a tagged name that appeared during the test is the test's.
    """
    before = our_segments()
    yield
    # Rings are unlinked as soon as both ends have mapped them, so a segment that appeared during
    # the test may still be in flight for a moment in a peer process; only one that outlives a short
    # grace period is a leak.
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = our_segments() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = our_segments() - before
    for name in leaked:  # clean up so one leak does not fail every later test
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture(scope="session")
def corpus_slice(tmp_path_factory) -> Path:
    """The first 150 documents of the shipped corpus as JSON lines (read-only: tests share it)."""
    return small_corpus(tmp_path_factory.mktemp("corpus-slice") / "slice.jsonl", CORPUS_SLICE_DOCUMENTS)


@pytest.fixture(scope="session")
def gpt2_corpus(corpus_slice: Path, tmp_path_factory) -> str:
    """``corpus_slice`` tokenized with GPT-2 BPE and ``--append-eod``: the ``--data-path`` prefix.

    Tests may add files beside it (megatron-core caches its sample indices under the prefix, one name
    per dataset configuration), never change the dataset itself."""
    return preprocess_gpt2(corpus_slice, tmp_path_factory.mktemp("gpt2-corpus") / "gpt2")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing entirely
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs: run through the device tool (tests/gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
