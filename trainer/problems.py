"""Every problem at once: checks collect what is wrong into a list, then raise one error naming all
of it, so that a user fixes bad input in one round instead of one error per run.

The one format of such an error is ``"<what>: <problem>; <problem>; ..."`` (``what`` says what was
checked, e.g. ``"invalid cost model"``). trainer.config's ConfigError lists its problems one per
line instead, because a whole command line's problems are many.

No imports: workflows/ imports it too (tests/unit/test_import_boundary.py).
"""

from __future__ import annotations


def problems_text(problems: list[str], what: str | None = None) -> str:
    """``"<what>: p1; p2"`` (``"p1; p2"`` without ``what``); empty problems are left out."""
    text = "; ".join(p for p in problems if p)
    return f"{what}: {text}" if what else text


def raise_if_any(problems: list[str], what: str | None = None, error: type[Exception] = ValueError) -> None:
    """Raise ``error(problems_text(problems, what))`` when any problem was found; else nothing."""
    if any(problems):
        raise error(problems_text(problems, what))
