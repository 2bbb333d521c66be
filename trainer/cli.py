"""The one parser class of every command line (trainer/, workflows/, datasets/, scripts/): bad input
is one line on stderr, ``<prog>: error: <what is wrong>``, and exit status 2, argparse's convention
for "the user's input is wrong, nothing was done". No usage dump: the line says which flag and value,
``--help`` says the rest.

Standard library only: workflows/ imports it too (tests/unit/test_import_boundary.py), and so do the
scripts that run before the project's dependencies are there. tests/unit/test_command_lines.py holds
every ``main`` to it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

EXIT_BAD_INPUT = 2  # the argparse convention: the user's input is wrong, nothing was done


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad input in one line naming the program (no usage dump) and exits 2.

    ``prog`` is required: the default (the basename of ``sys.argv[0]``) reads ``simulate.py`` under
    ``python -m`` and ``pytest`` under tests, so error lines would not say which command refused.
    Subparsers are of this class too (argparse builds them with ``type(parent)``)."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        super().__init__(prog=prog, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(message, prog=self.prog)

    def report(self, message: str) -> int:
        """Bad input found after parsing, for a ``main`` that returns its status: the same line as a
        parse error; returns the status to return."""
        print_error(message, self.prog)
        return EXIT_BAD_INPUT


def fail(message: str, prog: str) -> NoReturn:
    """Bad input found after parsing: the same one line and exit status as a parse error."""
    print_error(message, prog)
    sys.exit(EXIT_BAD_INPUT)


def print_error(message: str, prog: str) -> None:
    """The one error line, for a ``main`` whose bad input is found before or without a parser."""
    print(f"{prog}: error: {message}", file=sys.stderr)
