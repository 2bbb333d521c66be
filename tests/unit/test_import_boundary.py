"""workflows/ never imports torch or megatron; trainer/ never imports submitit or jinja2 (README.md#layout)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "workflows": {"torch", "megatron", "numpy", "trainer"},
    "trainer": {"submitit", "jinja2", "workflows"},
}


# The shared vocabulary (trainer/names.py), the problems collector (trainer/problems.py), the one
# parser class (trainer/cli.py) and the one way to stop a child's process group
# (trainer/launch/group_stop.py) are the trainer modules workflows/ may import; they import only the
# standard library, which test_the_shared_vocabulary_is_stdlib_only holds them to.
ALLOWED = {"workflows": {"trainer.names", "trainer.problems", "trainer.cli", "trainer.launch.group_stop"}}
# What each of them may import beyond __future__ and typing (the parser class is argparse's).
STDLIB_IMPORTS = {"trainer.cli": {"argparse", "sys"},
                  "trainer.launch.group_stop": {"os", "signal", "subprocess", "time"}}


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
        parts = module.split(".")
        package_inits = [REPO.joinpath(*parts[:depth], "__init__.py") for depth in range(1, len(parts))]
        allowed = {"__future__", "typing", *STDLIB_IMPORTS.get(module, ())}
        for path in (REPO / (module.replace(".", "/") + ".py"), *package_inits):
            assert _imported_roots(path) <= allowed, f"{path} must import only {sorted(allowed)}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = REPO / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists() or any(
        base.parent.glob(base.name + ".*.so"))


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, function-level (deferred) imports included: a
    deferred import that closes a circle is still a circle. ``from pkg import submodule`` is an edge
    to the submodule (its package's __init__ runs first whatever the form)."""
    graph: dict[str, set[str]] = {}
    for package in FORBIDDEN:
        for path in sorted((REPO / package).rglob("*.py")):
            edges = set()
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    edges |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        sub = f"{node.module}.{alias.name}"
                        edges.add(sub if _is_module(sub) else node.module)
            graph[_module_name(path)] = edges
    return {name: {e for e in edges if e in graph and e != name} for name, edges in graph.items()}


def test_the_import_graph_has_no_circle():
    graph, circles, state = _import_graph(), [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                circles.append(" -> ".join([*path[path.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, f"import circles (house style: the import graph is a tree): {circles}"
