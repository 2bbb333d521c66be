"""The shared vocabulary: names that the trainer's flags, the workflow knobs and the recipes all
accept, each written once here and read everywhere else.

Standard library only (no torch): it is the one trainer module that workflows/ may import
(tests/unit/test_import_boundary.py).
"""

from __future__ import annotations

from typing import Literal, get_args

Transport = Literal["auto", "shm", "nccl", "gloo"]
"""Stage-to-stage transports (``--transport``, the TRANSPORT knob). An RDMA transport does not
exist: never offer one."""
TRANSPORTS: tuple[str, ...] = get_args(Transport)

FileTokenizer = Literal["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"]
"""Tokenizers read from local vocabulary files (Megatron-LM's ``--tokenizer-type`` names): what
preprocessing and the recipes accept (trainer/data/tokenizer.py builds each)."""
FILE_TOKENIZERS: tuple[str, ...] = get_args(FileTokenizer)
TokenizerType = Literal[FileTokenizer, "NullTokenizer"]
"""What training's ``--tokenizer-type`` accepts: a file tokenizer, or NullTokenizer (token ids as
they are in the dataset, with ``--vocab-size``)."""
TOKENIZERS: tuple[str, ...] = get_args(TokenizerType)
