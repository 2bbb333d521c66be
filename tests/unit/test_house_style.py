"""House-style rules that keep one name for one thing across the code (issue 19)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_module_loggers_are_named_log():
    pattern = re.compile(r"^(\w+) = logging\.getLogger\(", re.MULTILINE)
    offenders = {
        str(f.relative_to(REPO)): names
        for package in ("trainer", "workflows")
        for f in sorted((REPO / package).rglob("*.py"))
        if (names := sorted(set(pattern.findall(f.read_text())) - {"log"}))
    }
    assert not offenders, f"module loggers are named `log`: {offenders}"


# Files that still join their problems by hand: being edited by other changes when trainer/problems.py
# landed (issue 19). (trainer/config.py raises its own one-problem-per-line ConfigError.)
PROBLEMS_BY_HAND_PENDING = {
    "trainer/bench/lines.py", "trainer/data/bert_dataset.py", "trainer/data/gpt_dataset.py",
    "trainer/data/preprocess.py", "trainer/data/split.py",
}


def test_problems_are_raised_through_the_collector():
    # The whole message, or its tail after a `+`, is a join: what raise_if_any does (a join inside an
    # f-string sentence is something else).
    pattern = re.compile(r"""raise \w+\((?:[^\n]*\+ )?["']; ["']\.join\(""")
    offenders = sorted(
        str(f.relative_to(REPO))
        for package in ("trainer", "workflows")
        for f in sorted((REPO / package).rglob("*.py"))
        if pattern.search(f.read_text()) and str(f.relative_to(REPO)) not in PROBLEMS_BY_HAND_PENDING
    )
    assert not offenders, f"raise collected problems with trainer.problems.raise_if_any/problems_text: {offenders}"
