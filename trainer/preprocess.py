"""``python -m trainer.preprocess``: JSONL -> Megatron-Core indexed dataset (see trainer/data/preprocess.py)."""

from __future__ import annotations

import sys

from trainer.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
