"""Shared pieces of the workflows command lines: one-line errors, exit codes."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_BAD_INPUT = 2  # the argparse convention: the user's input is wrong, nothing was done


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad input in one line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        fail(message, prog=self.prog)


def fail(message: str, prog: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def parse_assignment(text: str) -> tuple[str, str]:
    """KEY=VALUE -> (KEY, VALUE); argparse ``type`` for --env."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value
