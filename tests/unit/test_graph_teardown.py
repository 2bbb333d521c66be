"""Tear-down with --dpp-cuda-graphs, without a GPU: every captured graph is destroyed (``reset``) before
the process groups, in the order trainer/pipeline/graph_teardown.py gives, and the waits are bounded.

The graphs are stand-ins that record ``reset()`` (no CUDA here); the slot structure around them is
the real one (``_PairReplay`` over ``_GraphPair``, as capture_slot returns it). On GPUs
tests/gpu/test_tp_cuda_graphs.py checks that every rank logs the graphs it freed and exits cleanly.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.unit.test_cuda_graphs import B, H, S, _TinyGPT
from trainer.launch import distributed
from trainer.launch.exit_deadline import ExitDeadline
from trainer.pipeline import cuda_graphs
from trainer.pipeline.cuda_graphs import (
    ChunkGraphs,
    GraphShapes,
    _GraphPair,
    _PairReplay,
    free_captured_graphs,
)
from trainer.pipeline.graph_teardown import TeardownTimeout, free_graphs_before_groups


class _Graph:
    """A CUDA graph stand-in: records its reset (what destroys the executable on a GPU)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def reset(self) -> None:
        self.log.append(self.name)


def _captured(log: list, split: bool):
    """capture_slot's return value with stand-in graphs: {length: _PairReplay}, each tracked by the module
    the way _graph() tracks a real capture."""
    count = [0]

    def capture(call, shapes, masks, device):
        slot = count[0]
        count[0] += 1
        replays = {}
        for n in shapes.captured_lengths():
            graphs = [_Graph(f"s{slot}.{n}.{kind}", log) for kind in (("fwd", "bwd", "wgt") if split else ("fwd", "bwd"))]
            for g in graphs:
                cuda_graphs._CAPTURED.add(g)
            t = torch.zeros(1)
            replays[n] = _PairReplay(_GraphPair(graphs[0], graphs[1], t, t, t, t, graphs[2] if split else None))
        return replays

    return capture


def _chunk_graphs(log: list, slots: int = 2, lengths=(6, 4), split: bool = False) -> ChunkGraphs:
    shapes = GraphShapes(activation=(S, B, H), activation_dtype=torch.float32, tokens=(B, S), lengths=lengths)
    masks = {n: torch.ones(1, 1, n, n, dtype=torch.bool) for n in shapes.captured_lengths()}
    return ChunkGraphs(_TinyGPT(pre_process=True), True, slots, shapes, masks, torch.device("cpu"),
                       capture=_captured(log, split))


@pytest.mark.parametrize("split", [False, True], ids=["F+B", "F+I+W"])
def test_release_resets_every_graph_of_every_slot_and_length(split: bool) -> None:
    log: list = []
    graphs = _chunk_graphs(log, slots=2, lengths=(6, 4), split=split)
    per_pair = 3 if split else 2
    assert graphs.release() == 2 * 2 * per_pair
    # each graph destroyed exactly once, whatever else still holds the Python objects
    assert sorted(log) == sorted({*log}) and len(log) == 2 * 2 * per_pair
    assert graphs.slots == [] and graphs.release() == 0  # idempotent
    assert free_captured_graphs() == 0  # released graphs left the module's ledger


def test_free_captured_graphs_resets_graphs_no_chunk_holds() -> None:
    log: list = []
    stray = _Graph("half-captured", log)
    cuda_graphs._CAPTURED.add(stray)
    assert free_captured_graphs() == 1 and log == ["half-captured"]
    assert free_captured_graphs() == 0


def test_release_of_uncaptured_slots_frees_nothing() -> None:
    from tests.unit.test_cuda_graphs import _graphs

    assert _graphs(_TinyGPT(pre_process=True), first=True).release() == 0


class _Recorder:
    """The device operations of the tear-down, recorded in order."""

    def __init__(self, log: list, stray: int = 0, block: threading.Event | None = None) -> None:
        self.log, self.stray, self.block = log, stray, block

    def synchronize(self) -> None:
        if self.block is not None:
            self.block.wait(30)
        self.log.append("synchronize")

    def free_stray_graphs(self) -> int:
        self.log.append("free stray graphs")
        return self.stray

    def collect_garbage(self) -> None:
        self.log.append("collect garbage")

    def empty_cache(self) -> None:
        self.log.append("empty cache")


class _Chunk:
    def __init__(self, c: int, log: list) -> None:
        self.c, self.log = c, log

    def release(self) -> int:
        self.log.append(f"release chunk {self.c}")
        return 4


def test_teardown_waits_for_the_gpu_then_frees_graphs_then_memory() -> None:
    log: list = []
    freed = free_graphs_before_groups({1: _Chunk(1, log), 0: _Chunk(0, log)}, 3, _Recorder(log, stray=1), 10.0)
    assert log == ["synchronize", "release chunk 0", "release chunk 1", "free stray graphs", "collect garbage",
                   "empty cache"]
    assert freed.per_chunk == {0: 4, 1: 4} and freed.stray == 1 and freed.total == 9


def test_a_gpu_that_does_not_drain_is_named_and_no_graph_is_touched() -> None:
    log: list = []
    block = threading.Event()
    try:
        with pytest.raises(TeardownTimeout, match=r"rank 5: the GPU did not finish .* within 0.2 s .*unmatched"):
            free_graphs_before_groups({0: _Chunk(0, log)}, 5, _Recorder(log, block=block), 0.2)
        assert log == []
    finally:
        block.set()


def test_exit_deadline_names_rank_and_phase_then_exits_1() -> None:
    exited = threading.Event()
    codes: list = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    read, write = os.pipe()
    try:
        with ExitDeadline(7, 0.2, "destroying the process groups", exit=fake_exit, stderr_fd=write) as deadline:
            deadline.enter("destroying the tensor-parallel group")
            assert exited.wait(30), "the deadline never fired"
        os.close(write)
        text = os.read(read, 1 << 16).decode()
    finally:
        os.close(read)
    assert codes == [1]
    assert "[rank 7] ERROR rank 7: destroying the process groups did not finish within 0.2 s" in text
    assert "in 'destroying the tensor-parallel group'" in text and "Thread" in text  # the stacks follow


def test_exit_deadline_in_time_does_nothing() -> None:
    codes: list = []
    with ExitDeadline(0, 30.0, "x", exit=codes.append):
        pass
    assert codes == []


def test_shutdown_destroys_the_graph_groups_first_by_name(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda group=None: calls.append(group))
    tp = object()
    distributed.shutdown(0, {"tensor-parallel": tp}, timeout_s=30.0)
    assert calls == [tp, None]  # the TP group on its own, then everything else


def test_megatron_layer_graphs_are_reset_too() -> None:
    """--cuda-graph-impl local: each layer runner's forward and backward graph (megatron-core's
    _CudaGraphRunner attributes) is reset, a runner not captured yet has none."""
    from types import SimpleNamespace

    from trainer.pipeline.graph_teardown import free_megatron_graphs

    log: list = []
    layer = torch.nn.Linear(2, 2)
    layer.cudagraph_manager = SimpleNamespace(cudagraph_runners=[
        SimpleNamespace(fwd_graph=_Graph("l0.fwd", log), bwd_graph=_Graph("l0.bwd", log)),
        SimpleNamespace(fwd_graph=None, bwd_graph=None)])
    chunk = torch.nn.Sequential(layer, torch.nn.ReLU())
    assert free_megatron_graphs([chunk]) == 2 and log == ["l0.fwd", "l0.bwd"]
