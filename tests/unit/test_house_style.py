"""House-style rules that keep one name for one thing across the code."""

from __future__ import annotations

import ast
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


# Files that may join their problems by hand: none. (trainer/config/ raises its own
# one-problem-per-line ConfigError.)
PROBLEMS_BY_HAND_PENDING: set[str] = set()


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


def _is_main_guard(node) -> bool:  # noqa: ANN001
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and ast.unparse(node.test) == "__name__ == '__main__'")


def test_every_entry_point_exits_with_the_int_its_main_returns():
    """``python -m`` entry points: ``sys.exit(main())``, ``main`` annotated ``-> int`` (tests call it
    and compare the code), never a bare ``main()`` or an exit raised from inside."""
    problems, entry_points = [], 0
    for path in sorted([*(REPO / "trainer").rglob("*.py"), *(REPO / "workflows").rglob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        guards = [n for n in tree.body if _is_main_guard(n)]
        if not guards:
            continue
        entry_points += 1
        name = str(path.relative_to(REPO))
        if ast.unparse(guards[0].body[-1]) != "sys.exit(main())":
            problems.append(f"{name}: the __main__ block ends with {ast.unparse(guards[0].body[-1])!r}")
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        imported = any(isinstance(n, ast.ImportFrom) and any(a.name == "main" for a in n.names) for n in tree.body)
        if not imported and not (mains and mains[0].returns is not None and ast.unparse(mains[0].returns) == "int"):
            problems.append(f"{name}: no main(...) -> int")
    assert entry_points >= 10, "found almost no entry points: is the pattern still right?"
    assert not problems, "\n".join(problems)
