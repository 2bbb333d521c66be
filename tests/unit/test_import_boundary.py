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


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_boundary(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no python files under {package}/"
    offenders = {
        str(f.relative_to(REPO)): sorted(_imported_roots(f) & FORBIDDEN[package]) for f in files
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package}/ must not import {sorted(FORBIDDEN[package])}: {offenders}"
