"""Shared test fixtures: no leaked /dev/shm entries, GPU tests skipped without CUDA."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHM_PREFIX = "mdpp"  # every shared-memory name the project creates starts with this
LEAK_GRACE_S = 3.0


def _our_shm() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if p.name.startswith(SHM_PREFIX)} if shm.is_dir() else set()


@pytest.fixture(autouse=True)
def no_leaked_shared_memory():
    """Every test must leave /dev/shm as it found it (issue 3: no leaked segments after any test)."""
    before = _our_shm()
    yield
    # Rings are unlinked as soon as both ends have mapped them, so a segment that appeared during
    # the test may still be in flight for a moment in a peer process; only one that outlives a short
    # grace period is a leak.
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = _our_shm() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = _our_shm() - before
    for name in leaked:  # clean up so one leak does not fail every later test
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"


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
