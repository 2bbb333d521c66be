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
