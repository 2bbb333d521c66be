#!/usr/bin/env python3
"""Rebuild ``datasets/python-docs.jsonl.xz``: the project's sample corpus of real English text.

Source: the reStructuredText sources of the Python 3.11 documentation as shipped in Debian's
``python3.11-doc`` package (``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``; PSF License
Version 2, see datasets/README.md). The markup is reduced to plain prose: headings keep their title,
inline roles keep their text, comments / index / label directives and literal (code) blocks are
dropped, because the corpus is meant to be English text for language-model demos, not code.

Every section of every page becomes one JSON line ``{"text": ..., "source": "<page>#<n>"}``, so the
corpus has thousands of documents of paragraph length, like the web corpora Megatron is used on.

Usage (needs the network only to fetch the .deb; everything else is offline and deterministic)::

    python3 datasets/build_corpus.py                      # runs `apt-get download python3.11-doc`
    python3 datasets/build_corpus.py --deb python3.11-doc_3.11.2-6+deb12u8_all.deb
    python3 datasets/build_corpus.py --sources /usr/share/doc/python3.11/html/_sources
"""

from __future__ import annotations

import json
import lzma
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from trainer.cli import OneLineParser

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = HERE / "python-docs.jsonl.xz"
SOURCES_IN_DEB = Path("usr/share/doc/python3.11/html/_sources")
# Pages that are license texts or tables of contents, not prose worth training on.
SKIPPED_PAGES = {"license.rst.txt", "copyright.rst.txt", "contents.rst.txt", "bugs.rst.txt"}
MIN_SECTION_CHARS = 200  # shorter sections are mostly a heading plus a cross-reference

_ADORNMENT = re.compile(r"^([=\-~^\"'`#*+_.:<>])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_EXPLICIT_MARKUP = re.compile(r"^(\s*)\.\.(\s|$)")
# :role:`title <target>`, :role:`~mod.name`, :role:`!name` -> the words a reader sees
_ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`__?")
_LITERAL = re.compile(r"``(.+?)``")
_INTERPRETED = re.compile(r"`([^`]+)`_{0,2}")
_EMPHASIS = re.compile(r"\*\*?([^*\s][^*]*?)\*\*?")
_SUBSTITUTION = re.compile(r"\|(\w[\w -]*)\|")
_FOOTNOTE_REF = re.compile(r"\s*\[(#|\d+|\*)\]_")
_ISSUE_ROLE = re.compile(r":(issue|gh):`(\d+)`")
# Directives whose body is prose worth keeping (notes, warnings, API descriptions).
_PROSE_DIRECTIVES = {
    "note", "warning", "tip", "important", "seealso", "attention", "caution", "hint",
    "versionadded", "versionchanged", "deprecated", "deprecated-removed",
    "function", "method", "class", "exception", "attribute", "data", "describe", "module",
    "classmethod", "staticmethod", "decorator", "decoratormethod", "abstractmethod", "coroutinefunction",
    "coroutinemethod", "opcode", "cmdoption", "option", "envvar", "c:function", "c:macro", "c:type",
    "c:member", "c:var", "impl-detail", "availability", "glossary", "rubric", "topic",
}


def _role_text(match: re.Match[str]) -> str:
    text = match.group(1)
    if "<" in text and text.endswith(">"):  # explicit title: keep the title, drop the target
        text = text[: text.index("<")].rstrip()
    return text.lstrip("!~")


def clean_inline(line: str) -> str:
    """Inline reST markup -> the words a reader of the rendered page sees."""
    line = _ISSUE_ROLE.sub(lambda m: ("bpo-" if m.group(1) == "issue" else "gh-") + m.group(2), line)
    line = _FOOTNOTE_REF.sub("", line)
    line = _ROLE.sub(_role_text, line)
    line = _LINK.sub(r"\1", line)
    line = _LITERAL.sub(r"\1", line)
    line = _INTERPRETED.sub(r"\1", line)
    line = _EMPHASIS.sub(r"\1", line)
    line = _SUBSTITUTION.sub(r"\1", line)
    return line.replace("\\ ", "").replace("\\", "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _skip_block(lines: list[str], start: int, base_indent: int) -> int:
    """Index of the first line after the indented block that follows line ``start - 1``."""
    i = start
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base_indent):
        i += 1
    return i


def rst_to_sections(rst: str) -> Iterator[list[str]]:
    """Yield the prose lines of each section (a heading starts a new section)."""
    lines = rst.splitlines()
    section: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if _ADORNMENT.match(stripped):  # over/underline of a heading: drop it, keep the title
            i += 1
            continue
        if i + 1 < len(lines) and stripped and _ADORNMENT.match(lines[i + 1].strip()) \
                and len(lines[i + 1].strip()) >= len(stripped) and _indent(line) == 0:
            if section:
                yield section
            section = [clean_inline(stripped).rstrip(":") + ".", ""]
            i += 2
            continue
        directive = _DIRECTIVE.match(line)
        if directive:
            name, argument = directive.group(2), directive.group(3)
            i += 1
            if name not in _PROSE_DIRECTIVES:  # index, toctree, code-block, image, tables, ...
                i = _skip_block(lines, i, _indent(line))
                continue
            if argument and name not in {"versionadded", "versionchanged", "deprecated"}:
                section.append(clean_inline(argument))
            # directive options (":noindex:" etc.) are metadata, not text
            while i < len(lines) and re.match(r"^\s+:[\w-]+:", lines[i]):
                i += 1
            continue
        if _EXPLICIT_MARKUP.match(line):  # comments, labels, footnote targets
            i = _skip_block(lines, i + 1, _indent(line))
            continue
        if stripped.endswith("::"):  # the paragraph introduces a literal (code) block: drop the block
            kept = stripped[:-2].rstrip()
            if kept:
                section.append(clean_inline(kept) + ("" if kept.endswith(":") else ":"))
            i = _skip_block(lines, i + 1, _indent(line))
            continue
        if stripped.startswith(">>>"):  # a doctest block runs up to the next blank line
            while i < len(lines) and lines[i].strip():
                i += 1
            continue
        if stripped.startswith(("+--", "+==", "|")):  # grid tables and line blocks
            i += 1
            continue
        section.append(clean_inline(stripped))
        i += 1
    if section:
        yield section


def section_text(lines: list[str]) -> str:
    """Join wrapped lines into paragraphs separated by one blank line."""
    paragraphs, current = [], []
    for line in lines:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(p for p in paragraphs if re.search(r"[A-Za-z]", p))


def documents(sources: Path) -> Iterator[dict[str, str]]:
    for page in sorted(sources.rglob("*.rst.txt")):
        if page.name in SKIPPED_PAGES:
            continue
        name = page.relative_to(sources).as_posix().removesuffix(".rst.txt")
        for n, lines in enumerate(rst_to_sections(page.read_text(encoding="utf-8"))):
            text = section_text(lines)
            if len(text) >= MIN_SECTION_CHARS:
                yield {"text": text, "source": f"{name}#{n}"}


def extract_sources(deb: Path | None, workdir: Path) -> Path:
    if deb is None:
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=workdir, check=True)
        deb = next(workdir.glob("python3.11-doc_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "x")], check=True)
    return workdir / "x" / SOURCES_IN_DEB


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python3 datasets/build_corpus.py", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--deb", type=Path, help="a downloaded python3.11-doc .deb")
    group.add_argument("--sources", type=Path, help="an extracted html/_sources directory")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sources = args.sources or extract_sources(args.deb and args.deb.resolve(), Path(tmp))
        count = chars = 0
        # preset 9 | EXTREME: the file is committed, so spend CPU once to keep the repo small.
        with lzma.open(args.output, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as out:
            for doc in documents(sources):
                out.write(json.dumps(doc, ensure_ascii=False) + "\n")
                count += 1
                chars += len(doc["text"])
    print(f"wrote {args.output}: {count} documents, {chars / 1e6:.2f} M characters, "
          f"{args.output.stat().st_size / 1e6:.2f} MB compressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
