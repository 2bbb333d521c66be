"""Rank 0's failure record (the job's last line) names the peer when a collective, not one of the runtime's
links, was what noticed it gone: gloo's and NCCL's messages name an address, not a rank
(tests/slurm/test_rank_killed.py runs the real case: rank 1 killed while rank 0 was in megatron-core's
embedding-gradient all-reduce)."""

from __future__ import annotations

from trainer.train import lost_peer_text

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:43696: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")


def test_a_lost_connection_names_the_other_ranks() -> None:
    assert lost_peer_text(GLOO, 2) == ", which lost its connection to rank 1 in a collective"
    assert lost_peer_text(GLOO, 8) == ", which lost its connection to one of ranks 1-7 in a collective"
    assert lost_peer_text("NCCL error: remote process exited or there was a network error", 4).endswith(
        "one of ranks 1-3 in a collective")


def test_other_failures_and_single_rank_runs_add_nothing() -> None:
    assert lost_peer_text("CUDA out of memory. Tried to allocate 2.00 GiB", 4) == ""
    assert lost_peer_text(GLOO, 1) == ""
