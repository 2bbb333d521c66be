"""``python -m tests.unit.launch_victim``: a stand-in rank for tests/unit/test_local_ranks.py. Rank 0
fails at once; every other rank creates a shared-memory segment under the run token its launcher's
environment gives it, says its name, and then waits forever (like a peer blocked in a collective
whose rank 0 died), so only the launcher can end it."""

from __future__ import annotations

import os
import sys
import time

from trainer.names import make_token, ring_name, token_prefix

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    if rank == 0:
        sys.exit(1)
    name = ring_name(make_token(token_prefix(dict(os.environ)), 0xC0FFEE00 + rank), rank, 0, "next").lstrip("/")
    with open(f"/dev/shm/{name}", "wb") as segment:
        segment.write(b"\0" * 4096)
    print("SEGMENT", name, flush=True)
    time.sleep(3600)
