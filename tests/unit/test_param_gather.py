"""trainer.pipeline.param_gather: when the runtime starts and waits for the parameter all-gathers.

Stand-ins for megatron DDP chunks (no process group): each bucket group records its start and its
finish. What is checked is the runtime's part -- everything started in one fixed order after the
step, a chunk's groups waited for once before its first forward, megatron's forward pre-hooks
removed; the dist tier (test_dpp_equivalence.py, ``gpt-pp2-dp2-overlap-param-gather``) runs it with
megatron's real DDP, distributed optimizer and gloo.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.pipeline.param_gather import ParamGather


class _Group:
    """megatron's bucket group as far as the runtime sees it: a handle while a gather is in flight."""

    def __init__(self, chunk: int, index: int, log: list, fail: bool = False) -> None:
        self.name, self.log, self.fail = (chunk, index), log, fail
        self.param_gather_handle = None

    def start_param_sync(self, force_sync: bool = False) -> None:
        self.log.append(("start", *self.name, force_sync))
        if not force_sync:
            assert self.param_gather_handle is None, "megatron asserts: a gather already in flight"
        self.param_gather_handle = None if force_sync else "in flight"

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        if self.fail:
            raise TimeoutError("gloo timed out")
        self.log.append(("finish", *self.name, skip_next_bucket_dispatch))
        self.param_gather_handle = None


def _chunks(num: int, log: list, hooks: bool = True, groups: int = 2) -> list:
    chunks = []
    for c in range(num):
        chunk = SimpleNamespace(bucket_groups=[_Group(c, g, log) for g in range(groups)],
                                expert_parallel_bucket_groups=[],
                                ddp_config=SimpleNamespace(use_distributed_optimizer=True, overlap_param_gather=True),
                                remove_forward_pre_hook_handles={"module": "handle"} if hooks else {})

        def disable(param_sync: bool = True, chunk=chunk, c=c) -> None:
            log.append(("hooks off", c, param_sync))
            chunk.remove_forward_pre_hook_handles = {}

        chunk.disable_forward_pre_hook = disable
        chunks.append(chunk)
    return chunks


def test_megatrons_forward_pre_hooks_are_removed_without_a_gather() -> None:
    log: list = []
    gather = ParamGather(_chunks(2, log), rank=0)
    assert log == [("hooks off", 0, False), ("hooks off", 1, False)]  # param_sync=False: no collective
    log.clear()
    ParamGather(_chunks(1, log, hooks=False), rank=0)  # already off: left alone
    assert log == []
    gather.before_forward(0)  # first step: nothing was started, nothing to wait for
    assert log == [] and gather.pending == [False, False]


def test_all_start_after_the_step_in_one_order_and_each_chunk_waits_once() -> None:
    """Every DP replica issues the same collectives in the same order, whichever chunk runs first."""
    log: list = []
    gather = ParamGather(_chunks(2, log), rank=0)
    log.clear()
    gather.start()
    # chunk 0 then 1; within a chunk megatron's all-gather order (the reverse of its bucket-group list)
    assert log == [("start", 0, 1, False), ("start", 0, 0, False), ("start", 1, 1, False), ("start", 1, 0, False)]
    assert gather.pending == [True, True]
    log.clear()
    gather.before_forward(1)  # the policy may run chunk 1's forward first: only its groups are waited for
    assert log == [("finish", 1, 1, True), ("finish", 1, 0, True)]  # no chaining: all were started
    gather.before_forward(1)
    assert len(log) == 2 and gather.pending == [True, False]
    gather.finish_all()
    assert log[2:] == [("finish", 0, 1, True), ("finish", 0, 0, True)] and gather.pending == [False, False]
    assert (gather.started, gather.waited) == (2, 2)


def test_a_gather_never_waited_for_is_finished_before_the_next_start() -> None:
    log: list = []
    gather = ParamGather(_chunks(1, log, hooks=False, groups=1), rank=0)
    gather.start()
    gather.start()  # no forward in between: the one in flight is waited for first (force_sync)
    assert log == [("start", 0, 0, False), ("start", 0, 0, True), ("start", 0, 0, False)]
    gather.before_forward(0)
    gather.start()  # waited for: started again at once
    assert log[3:] == [("finish", 0, 0, True), ("start", 0, 0, False)]


def test_a_failed_wait_names_the_rank_the_chunk_and_the_flag() -> None:
    log: list = []
    chunks = _chunks(2, log, hooks=False, groups=1)
    chunks[1].bucket_groups[0].fail = True
    gather = ParamGather(chunks, rank=3)
    gather.start()
    with pytest.raises(RuntimeError, match=r"rank 3: waiting for chunk 1's parameter all-gather \(bucket group 1 "
                                           r"of 1.*--overlap-param-gather\) failed: gloo timed out"):
        gather.before_forward(1)


def test_supported_needs_the_distributed_optimizer_and_overlap_param_gather() -> None:
    def chunk(distopt: bool, gather: bool):
        return SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=distopt, overlap_param_gather=gather))

    assert ParamGather.supported(chunk(True, True))
    assert not ParamGather.supported(chunk(True, False)) and not ParamGather.supported(chunk(False, True))
    assert not ParamGather.supported(SimpleNamespace())
