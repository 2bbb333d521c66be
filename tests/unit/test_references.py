"""Every reference in the code and the docs resolves: markdown links (file and heading), paths cited in
docs, comments and docstrings (``docs/<file>.md#<heading>``, "see docs/<file>.md", a source file's path,
a glob such as ``tests/unit/test_recipes*.py``), dotted names (``trainer.schedule.core.cost_order``),
and no citation of the design card, which lives outside the repository."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP = ("trainer", "workflows", "tests", "scripts", "csrc", "docs", "sbatch", "containers", "datasets")
ROOT_FILES = ("README.md", "setup.py", "Makefile", "pyproject.toml")
SUFFIXES = {".py", ".md", ".sh", ".cpp", ".h", ".j2", ".toml", ".sbatch", ".cfg"}
# Not yet pointed at docs/: files another change is editing at the time (none now).
DESIGN_CARD_PENDING: set[str] = set()

_PATH = re.compile(r"(?<![\w/.$-])((?:README\.md|(?:" + "|".join(TOP) + r")/[\w./*-]*[\w*])(?:#[\w-]+)?)")
_DOTTED = re.compile(r"(?<![\w./-])((?:trainer|workflows)(?:\.\w+)+)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _sources() -> list[Path]:
    found = [REPO / name for name in ROOT_FILES if (REPO / name).exists()]
    for top in TOP:
        found += [p for p in (REPO / top).rglob("*") if p.is_file() and p.suffix in SUFFIXES
                  and "__pycache__" not in p.parts]
    return sorted(found)


def _python_prose(text: str) -> str:
    """Comments and docstrings (any string statement) of a Python file: where paths are cited in
    prose. Code and data strings are left out (tests name missing files on purpose)."""
    parts = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    parts += [node.value.value for node in ast.walk(ast.parse(text))
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)]
    return "\n".join(parts)


@cache
def _prose(path: Path) -> str:
    text = path.read_text()
    return _python_prose(text) if path.suffix == ".py" else text


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The heading anchors of a markdown file (fenced code blocks skipped; repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            base = slug(m.group(1))
            seen[base if base not in seen else f"{base}-{seen[base]}"] = 0
            seen[base] = seen.get(base, 0) + 1
    return frozenset(seen)


def _target_problem(target: Path, anchor: str | None) -> str | None:
    if "*" in target.name:
        return None if any(target.parent.glob(target.name)) else "the pattern matches no file"
    if not target.exists() and not any(target.parent.glob(target.name + ".*")):  # a module without suffix
        return "no such file"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"no heading #{anchor} in {target.relative_to(REPO)}"
    return None


def _where(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_slug_follows_github():
    assert slug("The DPP runtime (trainer/pipeline/dpp.py)") == "the-dpp-runtime-trainerpipelinedpppy"
    assert slug("Reference: Megatron-Core alone on 4 H200s") == "reference-megatron-core-alone-on-4-h200s"


def test_markdown_links_resolve():
    problems, checked = [], 0
    for path in (p for p in _sources() if p.suffix == ".md"):
        for target in _LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):  # http(s):, mailto:
                continue
            file, _, anchor = target.partition("#")
            checked += 1
            if why := _target_problem((path.parent / file).resolve() if file else path, anchor or None):
                problems.append(f"{_where(path)}: [..]({target}): {why}")
    assert checked > 10, "found almost no links: is the pattern still right?"
    assert not problems, "\n".join(problems)


def test_cited_paths_resolve():
    problems, checked = [], 0
    for path in _sources():
        for cited in set(_PATH.findall(_prose(path))):
            file, _, anchor = cited.partition("#")
            checked += 1
            if why := _target_problem(REPO / file, anchor or None):
                problems.append(f"{_where(path)}: {cited}: {why}")
    assert checked > 100, "found almost no cited paths: is the pattern still right?"
    assert not problems, "\n".join(problems)


def _module_file(name: str) -> Path | None:
    base = REPO / name.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py", *base.parent.glob(base.name + ".*.so")):
        if candidate.exists():
            return candidate
    return None


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    """Names a module defines or imports anywhere (functions, classes, assignments, imports): enough
    to tell a stale ``module.name`` from a real one without importing torch."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def _dotted_problem(dotted: str) -> str | None:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:k]))
        if module is not None:
            break
    else:
        return "no such module"
    if k == len(parts) or module.suffix != ".py" or parts[k] in ("py", "md"):
        return None
    if parts[k] not in _top_level_names(module):
        return f"{'.'.join(parts[:k])} has no {parts[k]}"
    return None


def test_dotted_names_resolve():
    problems, checked = [], 0
    for path in _sources():
        for dotted in set(_DOTTED.findall(_prose(path))):
            checked += 1
            if why := _dotted_problem(dotted):
                problems.append(f"{_where(path)}: {dotted}: {why}")
    assert checked > 100, "found almost no dotted names: is the pattern still right?"
    assert not problems, "\n".join(problems)


def test_no_citation_of_the_design_card():
    card = "DESIGN" + ".md"  # spelled in two so that this file does not cite it
    citing = [_where(p) for p in _sources() if card in p.read_text()]
    assert not set(citing) - DESIGN_CARD_PENDING, (
        f"{sorted(set(citing) - DESIGN_CARD_PENDING)} cite {card}, which is not in the repository: point "
        "them at docs/ headings")
