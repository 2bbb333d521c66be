"""Sentence splitting for ``--split-sentences`` without any run-time download.

Megatron-LM's preprocessing calls ``nltk.load("tokenizers/punkt/english.pickle")``, which needs the
NLTK data download. We ship Punkt parameters trained on our own corpus instead
(``datasets/punkt/english.json``, built by ``datasets/build_tokenizers.py``) in a plain JSON file:
a pickle would execute code on load and ties the file to one NLTK version.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # nltk is imported only when sentences are split, so GPT preprocessing never needs it
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

DEFAULT_PUNKT_PARAMS = Path(__file__).resolve().parents[2] / "datasets" / "punkt" / "english.json"
FORMAT_VERSION = 1


def punkt_params_to_json(params: PunktParameters) -> dict:
    """The four learned tables of a Punkt model as sorted, JSON-serialisable lists (stable diffs)."""
    return {
        "format_version": FORMAT_VERSION,
        "abbrev_types": sorted(params.abbrev_types),
        "collocations": sorted([a, b] for a, b in params.collocations),
        "sent_starters": sorted(params.sent_starters),
        "ortho_context": dict(sorted(params.ortho_context.items())),
    }


def punkt_params_from_json(data: dict) -> PunktParameters:
    from nltk.tokenize.punkt import PunktParameters

    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"Punkt parameter file has format_version={data.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    params = PunktParameters()
    params.abbrev_types = set(data["abbrev_types"])
    params.collocations = {(a, b) for a, b in data["collocations"]}
    params.sent_starters = set(data["sent_starters"])
    params.ortho_context = defaultdict(int, data["ortho_context"])
    return params


def _keep_newlines_language_vars():
    """Megatron-LM's CustomLanguageVars (tools/preprocess_data.py, ``--keep-newlines``): Punkt's sentence
    end followed by any whitespace, so the newlines after a sentence stay in it instead of being eaten."""
    from nltk.tokenize.punkt import PunktLanguageVars

    class KeepNewlines(PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # any whitespace, newlines included
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or some other token
            ))"""

    return KeepNewlines()


def load_sentence_splitter(path: str | Path = DEFAULT_PUNKT_PARAMS,
                           keep_newlines: bool = False) -> PunktSentenceTokenizer:
    """A Punkt sentence tokenizer from a JSON parameter file; FileNotFoundError names a missing path.
    ``keep_newlines``: Megatron-LM's --keep-newlines language variables."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Punkt sentence model not found: {path}")
    params = punkt_params_from_json(json.loads(path.read_text(encoding="utf-8")))
    if keep_newlines:
        return PunktSentenceTokenizer(params, lang_vars=_keep_newlines_language_vars())
    return PunktSentenceTokenizer(params)
