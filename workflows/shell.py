"""Shell quoting for the sbatch templates.

Every value a template interpolates must pass through :func:`quote` (or :func:`name` for a variable
name). Both return :class:`ShellWord`, and the Jinja environment's ``finalize`` hook rejects any
other type (see :mod:`workflows.render`), so a value that skipped quoting fails the render instead of
reaching a job script.
"""

from __future__ import annotations

import re
import shlex
import string
from dataclasses import dataclass
from pathlib import PurePosixPath

_NAME = re.compile(r"[A-Z_][A-Z0-9_]*\Z")


class ShellWord(str):
    """A string already safe to paste into a bash script at a word position."""


@dataclass(frozen=True)
class Ref:
    """A default that refers to another shell variable, e.g. ``$DATA_PATH/gpt2/sample``.

    Rendered as ``"${NAME}"'suffix'``: the variable expands at job time, the suffix stays literal.
    """

    variable: str
    """Name of the shell variable (upper case, defined earlier in the same script)."""
    suffix: str = ""
    """Literal text appended after the variable's value."""
    basename: bool = False
    """Take the last component of the variable's path (``basename``) instead of the whole value."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.variable):
            raise ValueError(f"Ref.variable must be an upper-case shell name, got {self.variable!r}")

    def shell(self) -> str:
        value = f'"$(basename "${{{self.variable}}}")"' if self.basename else f'"${{{self.variable}}}"'
        return value + (shlex.quote(self.suffix) if self.suffix else "")

    def resolve(self, env: dict[str, str]) -> str:
        """The value bash would produce, given the variables already set."""
        value = env[self.variable]
        return (PurePosixPath(value).name or value if self.basename else value) + self.suffix


def template(text: str) -> ShellWord:
    """Jinja filter ``fmt``: a ``str.format`` pattern such as ``{REPO_DIR}/runs/{MODEL}-{JOB_ID}`` as
    one shell word that expands the same variables at job time (Python and bash share the pattern)."""
    parts = []
    for literal, field, spec, conversion in string.Formatter().parse(text):
        if literal:
            parts.append(shlex.quote(literal))
        if field is not None:
            if spec or conversion or not _NAME.match(field):
                raise ValueError(f"pattern {text!r}: {{{field}}} must be a plain upper-case shell name")
            parts.append(f'"${{{field}}}"')
    return ShellWord("".join(parts))


def quote(value: object) -> ShellWord:
    """Jinja filter ``q``: one shell word for ``value`` (str, int, float, bool, Ref, None -> '')."""
    if isinstance(value, ShellWord):
        return value
    if isinstance(value, Ref):
        return ShellWord(value.shell())
    if value is None:
        return ShellWord("''")
    if isinstance(value, bool):  # before int: bool is an int
        return ShellWord("1" if value else "0")
    if isinstance(value, int | float | str):
        return ShellWord(shlex.quote(str(value)))
    raise TypeError(f"cannot shell-quote a {type(value).__name__}: {value!r}")


def name(value: object) -> ShellWord:
    """Jinja filter ``name``: a shell variable name, validated rather than quoted."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"not an upper-case shell variable name: {value!r}")
    return ShellWord(value)


def as_text(value: object) -> str:
    """The plain-text form of a knob value, as the job would see it when no Ref is involved."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
