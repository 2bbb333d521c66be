"""Shared pieces of the workflows command lines: one-line errors, exit codes, KEY=VALUE arguments.

The parser class and ``fail`` are trainer.cli's, the one parser of every command line of the project
(re-exported here so that workflows modules keep one import)."""

from __future__ import annotations

import argparse

from trainer.cli import EXIT_BAD_INPUT, OneLineParser, fail

__all__ = ["EXIT_BAD_INPUT", "OneLineParser", "fail", "parse_assignment"]


def parse_assignment(text: str) -> tuple[str, str]:
    """KEY=VALUE -> (KEY, VALUE); argparse ``type`` for --env."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value
