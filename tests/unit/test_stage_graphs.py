"""--dpp-held-cap fit (trainer/pipeline/stage_graphs.py): each stage starts from its own 1F1B bound and
captures more graph slots, up to stage 0's bound, while its memory stays within the job's largest rank at
the stages' own bounds; the ranks of a stage keep the smallest count any of them reached.

On CPU the slots are the stand-in captures of tests/unit/test_cuda_graphs.py and the device memory is a
model (``base + cost x slots``, given per stage, in GiB): the decisions are what is checked, the memory
itself is the GPU runs' (docs/bench)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_cuda_graphs import _graphs, _TinyGPT
from trainer.pipeline import cuda_graphs
from trainer.pipeline.stage_graphs import HeldFit, SlotReport, agreed_slots, fit_held_slots, memory_budget

GIB = 2**30
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_device_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graphs, "release_cached_blocks", lambda device: None)


def _fit(stage: int, own: int, base: float, cost: float, others: list[SlotReport], peers: list[tuple[int, int]] = (),
         first_cost: float | None = None, pending: float = 0.0, peak: int = 4) -> tuple[int, cuda_graphs.ChunkGraphs]:
    """Fit stage ``stage`` (``own`` slots captured, each ``cost`` GiB, the first ``first_cost``) against the
    other ranks' reports; ``peers``: the other ranks' final (stage, slots)."""
    graphs = _graphs(_TinyGPT(pre_process=False), False, slots=own)
    graphs.slot_bytes = [int((first_cost if i == 0 and first_cost is not None else cost) * GIB) for i in range(own)]

    def reserved() -> int:
        n = len(graphs.slots)
        return int((base + (first_cost if first_cost is not None else cost) + cost * (n - 1)) * GIB)

    def gather(value):
        return [value, *others] if isinstance(value, SlotReport) else [value, *peers]

    fit = HeldFit(own=own, peak=peak, pending_bytes=int(pending * GIB), gather=gather, reserved=reserved)
    return fit_held_slots(graphs, stage, fit, CPU), graphs


def _report(stage: int, used: float, per_slot: float) -> SlotReport:
    return SlotReport(stage, int(used * GIB), int(per_slot * GIB))


# The other stages of a BERT-like PP=4 job at their own bounds (4/3/2/1 slots), optimizer state included.
BERT_LIKE = [_report(0, 8.5, 1.0), _report(1, 7.8, 1.3), _report(2, 6.5, 1.3)]


def test_the_pure_rules() -> None:
    reports = [_report(0, 8.5, 1.0), _report(3, 6.2, 1.3), _report(3, 6.4, 1.3)]
    assert memory_budget(reports) == int(8.5 * GIB)
    assert agreed_slots([(0, 4), (3, 3), (3, 2), (1, 1)], 3) == 2


def test_a_stage_whose_slots_cost_more_stops_where_the_largest_rank_is() -> None:
    """The last stage: 1 slot at its own bound (4.9 GiB + 1.3 for the slot); the budget is stage 0's 8.5:
    one more slot fits (7.5), a third would not (8.8), so it holds 2, not peak's 4."""
    held, graphs = _fit(3, own=1, base=4.9, cost=1.3, others=BERT_LIKE)
    assert held == 2 and len(graphs.slots) == 2 and graphs.recomputes == [None, None]
    assert sorted(graphs._free) == [0, 1]  # both slots can be taken


def test_where_every_stage_fits_the_peak_bound_is_kept_and_the_largest_rank_keeps_its_own() -> None:
    gpt_like = [_report(0, 13.5, 1.9), _report(1, 9.6, 1.8), _report(2, 7.8, 1.8)]
    held, _ = _fit(3, own=1, base=5.0, cost=1.4, others=gpt_like)
    assert held == 4  # 5.0 + 4 x 1.4 = 10.6 GiB, within 13.5
    largest, _ = _fit(0, own=4, base=6.0, cost=1.9, others=[_report(1, 9.6, 1.8)])
    assert largest == 4  # already at its bound, which is the peak


def test_the_optimizer_state_still_to_come_counts() -> None:
    """The same last stage with 2.5 GiB of Adam state its first step will allocate: 4.9 + 1.3 + 2.5 = 8.7 GiB
    at its own bound is above the budget already, so it keeps its one slot."""
    held, _ = _fit(3, own=1, base=4.9, cost=1.3, others=BERT_LIKE, pending=2.5)
    assert held == 1


def test_a_slot_that_did_not_fit_after_all_is_destroyed_again() -> None:
    """The prediction (the first slot's 0.5 GiB) is short of what the next slots cost (2.0): the captured
    slot that went over the budget is released, the stage holds what fitted."""
    held, graphs = _fit(3, own=1, base=5.0, cost=2.0, first_cost=0.5, others=BERT_LIKE)
    # 5.5 at 1 slot; predicted 6.0 -> captured: 7.5 (fits); predicted 9.5 > 8.5: stop
    assert held == 2 and len(graphs.slots) == 2
    held, graphs = _fit(3, own=1, base=7.5, cost=1.5, first_cost=0.4, others=BERT_LIKE)
    # 7.9 at 1 slot; predicted 8.3 -> captured: 9.4 > 8.5, destroyed again
    assert held == 1 and len(graphs.slots) == 1 and graphs.slot_bytes == [int(0.4 * GIB)]


def test_the_ranks_of_a_stage_keep_the_smallest_count_any_of_them_reached() -> None:
    """A tensor-parallel peer of the last stage reached 1 slot where this rank reached 2: both hold 1, so they
    take and replay the same slots in the same order."""
    held, graphs = _fit(3, own=1, base=4.9, cost=1.3, others=BERT_LIKE, peers=[(0, 4), (3, 1), (1, 3)])
    assert held == 1 and len(graphs.slots) == 1


def test_resizing_is_refused_once_a_slot_is_taken() -> None:
    graphs = _graphs(_TinyGPT(pre_process=False), False, slots=2)
    graphs.resize(3)
    assert len(graphs.slots) == 3 and len(graphs.recomputes) == 3
    x = torch.zeros(graphs.shapes.activation)
    assert graphs.take(0, x) is not None
    with pytest.raises(RuntimeError, match="resized before the first step"):
        graphs.resize(1)
