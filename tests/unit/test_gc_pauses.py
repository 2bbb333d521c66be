"""trainer.profiling.manual_gc.GcPauses: Python's collections inside training steps, for the end-of-run log line."""

from __future__ import annotations

import gc

import pytest

from trainer.profiling.manual_gc import GcPauses


@pytest.fixture
def no_automatic_gc():
    """Only the collections a test asks for."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


def test_counts_the_collections_inside_steps_only(no_automatic_gc) -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect()  # between steps: not counted
        with pauses.in_step():
            gc.collect(0)
            gc.collect(2)
        gc.collect(1)
    finally:
        pauses.uninstall()
    with pauses.in_step():
        gc.collect()  # uninstalled: not seen
    assert pauses.count == [1, 0, 1]
    assert 0 < pauses.longest_s <= pauses.total_s
    text = pauses.summary(manual=False, hint_ms=0.0)
    assert text.startswith("2 garbage collection(s) ran inside training steps (generation 0/1/2: 1/0/1), ")
    assert "--manual-gc runs them between steps" in text
    assert "--manual-gc" not in pauses.summary(manual=True, hint_ms=0.0)  # already on
    assert "--manual-gc" not in pauses.summary(manual=False, hint_ms=1e3 * pauses.longest_s + 1)  # too short
    assert pauses._timer._on_gc not in gc.callbacks


def test_a_step_that_raises_ends_the_step_and_none_says_none(no_automatic_gc) -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        with pytest.raises(RuntimeError), pauses.in_step():
            raise RuntimeError("step failed")
        gc.collect()
    finally:
        pauses.uninstall()
    assert pauses.count == [0, 0, 0]
    assert pauses.summary(manual=True) == "0 garbage collection(s) ran inside training steps (generation 0/1/2: 0/0/0), 0.0 ms in all"
