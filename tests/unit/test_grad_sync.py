"""trainer.pipeline.grad_sync: when the runtime starts each chunk's overlapped DP reduction.

Stand-ins for megatron DDP chunks (no process group): each bucket group records its start. What
is checked is the runtime's part -- after which backward a chunk's reduction starts, and in which
order across chunks, whatever order the chunks complete in; the dist tier
(test_dpp_equivalence.py, the ``overlap`` layouts) runs it with megatron's real DDP and gloo.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from trainer.pipeline.grad_sync import ChunkReduction, GradSync


def _chunks(num: int, started: list, overlap: bool = True, runtime: bool = True) -> list:
    chunks = []
    for c in range(num):
        groups = [SimpleNamespace(start_grad_sync=lambda force_all_reduce, c=c, g=g: started.append((c, g,
                                                                                                     force_all_reduce)))
                  for g in range(2)]
        no_sync_log: list = []

        @contextlib.contextmanager
        def no_sync(log=no_sync_log):
            log.append("enter")
            yield
            log.append("exit")

        chunks.append(SimpleNamespace(bucket_groups=groups, expert_parallel_bucket_groups=[], force_all_reduce=False,
                                      ddp_config=SimpleNamespace(overlap_grad_reduce=overlap), no_sync=no_sync,
                                      no_sync_log=no_sync_log, reduction_launched_by_runtime=runtime,
                                      parameters=list))
    return chunks


def _config(chunks: list) -> SimpleNamespace:
    return SimpleNamespace(no_sync_func=[c.no_sync for c in chunks], grad_sync_func=None)


def test_a_chunk_starts_after_its_last_backward_only() -> None:
    started: list = []
    chunks = _chunks(1, started)
    with GradSync(_config(chunks), chunks, num_microbatches=3, forward_only=False, force_all_reduce=True) as sync:
        for _ in range(3):
            sync.before_backward(0)
            assert started == []  # nothing before the 3rd backward has run
            sync.after_backward(0)
        assert started == [(0, 0, True), (0, 1, True)]  # megatron's bucket-group order
        assert chunks[0].no_sync_log == ["enter"]  # no_sync stays on: the hooks never count readiness
        assert sync.reductions_started == [True]
    assert chunks[0].no_sync_log == ["enter", "exit"]


def test_chunks_start_in_the_fixed_order_whatever_order_they_complete_in() -> None:
    """dpp-zb's deferred W steps may complete chunk 0 before chunk 1; every DP replica must still
    issue the collectives in one order (v-1 .. 0)."""
    started: list = []
    chunks = _chunks(2, started)
    with GradSync(_config(chunks), chunks, num_microbatches=2, forward_only=False) as sync:
        for _ in range(2):
            sync.after_backward(0)
        assert started == []  # chunk 0 is complete, but chunk 1 goes first
        sync.after_backward(1)
        assert started == []
        sync.after_backward(1)
        assert [(c, g) for c, g, _ in started] == [(1, 0), (1, 1), (0, 0), (0, 1)]


def test_megatrons_protocol_without_runtime_launch() -> None:
    """Without --overlap-grad-reduce (or with megatron's own DDP), no_sync is left before the last
    backward and nothing is started here."""
    for overlap, runtime in ((False, True), (True, False)):
        started: list = []
        chunks = _chunks(1, started, overlap=overlap, runtime=runtime)
        assert not ChunkReduction.supported(chunks[0])
        with GradSync(_config(chunks), chunks, num_microbatches=2, forward_only=False) as sync:
            for _ in range(2):
                sync.before_backward(0)
                sync.after_backward(0)
            assert chunks[0].no_sync_log == ["enter", "exit"] and sync.reductions_started == []
        assert started == []


def test_forward_only_starts_nothing() -> None:
    started: list = []
    chunks = _chunks(1, started)
    with GradSync(_config(chunks), chunks, num_microbatches=1, forward_only=True) as sync:
        sync.after_backward(0)
    assert started == [] and chunks[0].no_sync_log == []
