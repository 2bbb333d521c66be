"""The tests' load-stretched budgets (tests/timeouts.py): longer under load, never shorter than the
idle budget, bounded, and a failure that says what was waited for, the state seen and the load."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import timeouts


@pytest.fixture
def load(monkeypatch):
    value = [0.0]
    monkeypatch.setattr(timeouts.os, "getloadavg", lambda: (value[0], value[0], value[0]))
    monkeypatch.setattr(timeouts, "cores", lambda: 2)
    return value


def test_the_stretch_follows_load_per_core_between_one_and_its_cap(load):
    for level, expected in ((0.5, 1.0), (2.0, 1.0), (7.0, 3.5), (50.0, timeouts.MAX_STRETCH)):
        load[0] = level
        assert timeouts.stretch() == expected
    assert timeouts.ceiling(100) == 100 * timeouts.MAX_STRETCH


def test_a_budget_grows_when_the_load_rises_during_the_wait_and_never_shrinks(load):
    load[0] = 1.0
    budget = timeouts.Budget(0.2, "something")
    budget.started -= 0.3  # past the idle budget
    load[0] = 6.0  # ... but the machine got busy meanwhile
    assert not budget.expired() and budget.allowed_s == pytest.approx(0.6)
    load[0] = 0.0
    budget.started -= 0.4
    assert budget.expired() and budget.factor == 3.0


def test_a_wait_that_runs_out_names_what_it_waited_for_the_state_and_the_load(load):
    load[0] = 1.0
    with pytest.raises(AssertionError) as caught:
        timeouts.wait_until(lambda: False, 0.3, "the job to start", state=lambda: "PENDING", poll_s=0.05)
    text = str(caught.value)
    assert text.startswith("the job to start: not done after") and "last seen: PENDING" in text, text
    assert "budget 0 s idle, x1.0 for load 1.0/1.0/1.0 on 2 cores" in text, text


def test_communicate_within_kills_a_process_past_its_budget_and_keeps_its_output(load):
    load[0] = 1.0
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with pytest.raises(AssertionError) as caught:
        timeouts.communicate_within(proc, 2.0, "the sleeper to end", state=lambda: "asleep")
    assert proc.poll() is not None
    assert "the sleeper to end: not done after" in str(caught.value) and "asleep" in str(caught.value)
    assert "started" in str(caught.value)
    done = subprocess.Popen([sys.executable, "-c", "print('hi')"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert timeouts.communicate_within(done, 30.0, "a quick one") == ("hi\n", "")
