"""workflows/ never imports torch or megatron; trainer/ never imports submitit or jinja2 (DESIGN.md §1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "workflows": {"torch", "megatron", "numpy", "trainer"},
    "trainer": {"submitit", "jinja2", "workflows"},
}


# The shared vocabulary (trainer/names.py) and the problems collector (trainer/problems.py) are the
# trainer modules workflows/ may import; they import only the standard library, which
# test_the_shared_vocabulary_is_stdlib_only holds them to.
ALLOWED = {"workflows": {"trainer.names", "trainer.problems"}}


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def _imported_roots(path: Path, allowed: set[str] = frozenset()) -> set[str]:
    return {m.split(".")[0] for m in _imported_modules(path) - allowed}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_boundary(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no python files under {package}/"
    offenders = {
        str(f.relative_to(REPO)): sorted(_imported_roots(f, ALLOWED.get(package, set())) & FORBIDDEN[package])
        for f in files
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package}/ must not import {sorted(FORBIDDEN[package])}: {offenders}"


def test_the_shared_vocabulary_is_stdlib_only():
    for module in sorted(set().union(*ALLOWED.values())):
        package_init = REPO / module.split(".")[0] / "__init__.py"
        for path in (REPO / (module.replace(".", "/") + ".py"), package_init):
            assert _imported_roots(path) <= {"__future__", "typing"}, f"{path} must import only typing"
