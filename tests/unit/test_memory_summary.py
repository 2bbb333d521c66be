"""trainer.profiling.memory_summary reads an allocator snapshot (--record-memory-history) and says where
the reserved memory goes: per pool (ordinary, CUDA graphs' private pools), the ordinary pool's live
tensors by the code that allocated them, and the peak over the recorded history with who reached it.
The snapshots here are hand-made dictionaries of torch.cuda.memory._snapshot()'s documented shape (no GPU
on this machine); tests/gpu/test_memory_history_gpu.py reads real ones."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from trainer.config import ConfigError, parse_config
from trainer.profiling.memory_history import oom_path, rank_path
from trainer.profiling.memory_summary import GIB, MIB, live_tensors, main, peak, pools

MODEL = [{"filename": "/x/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
         {"filename": "/repo/trainer/pipeline/cuda_graphs.py", "line": 330, "name": "capture_slot"}]
EMBED = [{"filename": "/site/megatron/core/models/common/embeddings/language_model_embedding.py", "line": 90,
          "name": "forward"}]


def _segment(address: int, size: int, pool=(0, 0), blocks=()) -> dict:
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"address": address, "total_size": size, "segment_pool_id": pool, "allocated_size": allocated,
            "active_size": allocated, "stream": 0, "segment_type": "large", "blocks": list(blocks)}


def _block(size: int, frames, state="active_allocated") -> dict:
    return {"size": size, "requested_size": size, "address": 0, "state": state, "frames": frames}


def _snapshot() -> dict:
    """Ordinary pool: 2 GiB (1.5 allocated: 1 GiB by the embedding, 0.5 by the model code); one graph pool
    of 3 GiB (nothing allocated between replays). History: a 1 GiB ordinary segment, then the graph pool's
    3 GiB segment (the peak: 5 GiB), then a 0.5 GiB segment freed again."""
    ordinary = _segment(0x1000, 2 * GIB, blocks=[_block(GIB, EMBED), _block(GIB // 2, MODEL),
                                                _block(GIB // 2, MODEL, "inactive")])
    graph = _segment(0x9000, 3 * GIB, pool=(1, 7), blocks=[_block(3 * GIB, MODEL, "inactive")])
    trace = [{"action": "segment_alloc", "addr": 0x1000, "size": GIB, "frames": EMBED},
             {"action": "alloc", "addr": 0x1000, "size": GIB, "frames": EMBED},
             {"action": "segment_alloc", "addr": 0x9000, "size": 3 * GIB, "frames": []},
             {"action": "alloc", "addr": 0x9000, "size": 3 * GIB, "frames": MODEL},
             {"action": "segment_alloc", "addr": 0x5000, "size": GIB // 2, "frames": []},
             {"action": "segment_free", "addr": 0x5000, "size": GIB // 2, "frames": []}]
    return {"segments": [ordinary, graph], "device_traces": [trace]}


def test_reserved_memory_by_pool_and_the_ordinary_pools_tensors_by_who_allocated_them() -> None:
    by_pool = pools(_snapshot())
    assert list(by_pool) == ["private pool (1, 7) (CUDA graphs)", "ordinary pool"]
    assert by_pool["ordinary pool"] == (2 * GIB, int(1.5 * GIB), 1) and by_pool[next(iter(by_pool))][1] == 0
    live = live_tensors(_snapshot())
    assert [(size, blocks) for _, size, blocks in live] == [(GIB, 1), (GIB // 2, 1)]
    assert "megatron/core/models/common/embeddings" in live[0][0]
    assert live[1][0] == "trainer/pipeline/cuda_graphs.py:330 capture_slot"  # the project's frame, not torch's


def test_the_peak_over_the_history_and_the_allocation_that_reached_it() -> None:
    # Now 5 GiB reserved; the history added 1 + 3 + 0.5 - 0.5: it started at 1 GiB, peaked at 5.5 GiB.
    p = peak(_snapshot())
    assert (p.start, p.reserved, p.size) == (GIB, int(5.5 * GIB), GIB // 2)
    assert p.index == 4 and p.pool == "a segment freed since" and p.events == 6
    snapshot = _snapshot()
    snapshot["device_traces"][0] = snapshot["device_traces"][0][:4]  # without the short-lived segment
    p = peak(snapshot)
    assert (p.reserved, p.index, p.pool) == (5 * GIB, 2, "private pool (1, 7) (CUDA graphs)")
    assert p.where == "trainer/pipeline/cuda_graphs.py:330 capture_slot"
    assert peak({"segments": [], "device_traces": []}) is None


def test_the_command_reports_each_file_and_names_one_it_cannot_read(tmp_path: Path, capsys) -> None:
    good, bad, other = tmp_path / "snap_rank0.pickle", tmp_path / "broken.pickle", tmp_path / "other.pickle"
    good.write_bytes(pickle.dumps(_snapshot()))
    bad.write_bytes(b"not a pickle")
    other.write_bytes(pickle.dumps({"x": 1}))
    assert main([str(good), str(bad), str(other)]) == 1
    out, err = capsys.readouterr()
    assert f"== {good}" in out and "5.00 GiB in all" in out and "peak reserved over the recorded history: 5.50" in out
    assert f"{bad}: cannot read a snapshot" in err and f"{other}: not an allocator snapshot" in err
    assert f"{GIB / MIB:9.1f} MiB in    1 block(s)" in out


def test_each_rank_writes_its_own_snapshot_and_the_flags_are_checked_before_start() -> None:
    assert rank_path(None, 3).name == "snapshot_rank3.pickle"
    assert rank_path("/out/mem.pkl", 0) == Path("/out/mem_rank0.pkl")
    assert oom_path("/out/mem.pkl", 2) == Path("/out/oom_rank-2_mem.pkl")
    base = ["--mock-data", "--num-layers", "2"]
    assert parse_config([*base, "--device", "cuda", "--record-memory-history"], world_size=1).run.record_memory_history
    with pytest.raises(ConfigError, match="--record-memory-history records the CUDA allocator: it needs --device cuda"):
        parse_config([*base, "--device", "cpu", "--record-memory-history"], world_size=1)
    with pytest.raises(ConfigError, match="--memory-snapshot-path=m.pickle needs --record-memory-history"):
        parse_config([*base, "--device", "cuda", "--memory-snapshot-path", "m.pickle"], world_size=1)
