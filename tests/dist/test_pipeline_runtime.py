"""trainer/pipeline/runtime.py on real processes: what PipelineRuntime opens (stage links, TP decision
channel, tracer) is closed again on exit and when opening fails halfway -- no shared memory left
mapped or named (conftest.py fails any test that leaves a segment of its own), no receiver thread left
running, and the set-up's own error is the one raised."""

from __future__ import annotations

import gc
import json
import threading
import uuid
from pathlib import Path

import pytest
import torch

from tests.model_flags import model_flags
from tests.shm_tag import tagged
from trainer.config import parse_config
from trainer.launch.local_ranks import check_all_ok, run_processes
from trainer.launch.topology import Topology
from trainer.pipeline.runtime import PipelineRuntime

ARGS = [*model_flags(), "--micro-batch-size", "1", "--global-batch-size", "4",
        "--use-dpp", "--train-iters", "1", "--transport", "shm"]
LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"], "tp2": ["--tensor-model-parallel-size", "2"]}


class TracerFailed(RuntimeError):
    pass


def _failing_tracer(profile_dir, rank: int, metadata: dict):  # noqa: ANN001
    """Stands for a tracer that cannot be built: the step after the links and the TP channel."""
    raise TracerFailed(f"rank {rank}: no tracer for {metadata['schedule']}")


def _mapped_shared_memory() -> list[str]:
    """The project's shared-memory segments this process still maps (unlinked ones included)."""
    return [line.split(maxsplit=5)[5] for line in Path("/proc/self/maps").read_text().splitlines()
            if "/dev/shm/mdpp" in line]


def _still_owned(runtime: PipelineRuntime) -> list[str]:
    return [name for name in ("links", "tp_channel", "tracer") if getattr(runtime, name) is not None]


def _runtime(rank: int, world: int, layout: str, token: str, tracer_factory=None, profile_dir=None):  # noqa: ANN001
    from trainer.launch.distributed import init_megatron_parallel

    argv = ARGS + LAYOUTS[layout] + (["--profile-dir", profile_dir] if profile_dir else [])
    cfg = parse_config(argv, world_size=world)
    par = cfg.parallel
    topo = Topology(world_size=world, rank=rank, tensor_parallel=par.tensor_model_parallel_size,
                    pipeline_parallel=par.pipeline_model_parallel_size)
    init_megatron_parallel(topo)  # the TP channel's group is megatron-core's
    return PipelineRuntime(cfg, topo, torch.device("cpu"), token, cfg.num_microbatches(world), model=[],
                           microbatch_data=lambda m, c: None, tracer_factory=tracer_factory)


def _open_with_one_failing_rank(rank: int, world: int, layout: str, failing: int, token: str) -> dict:
    """Rank ``failing``'s tracer raises; its peer opens everything and leaves the block normally
    (its links' close waits for the failed rank's end of stream: only sent if that rank closed them)."""
    threads = {t.name for t in threading.enumerate()}
    runtime = _runtime(rank, world, layout, token, _failing_tracer if rank == failing else None)
    result: dict = {"mapped_while_open": []}
    if rank == failing:
        try:
            runtime.open()
        except TracerFailed as exc:
            result["error"] = str(exc)
    else:
        with runtime:
            result["mapped_while_open"] = _mapped_shared_memory()
            result["forward_backward"] = runtime.forward_backward is not None
    result["owned_after"] = _still_owned(runtime)
    result["mapped_after_close"] = _mapped_shared_memory()
    # A closed ring is unmapped when its last reference goes (a delivered tensor may still view a
    # slot); the opened rank's DppContext still holds its links until the runtime itself goes.
    del runtime
    gc.collect()
    result["mapped_after"] = _mapped_shared_memory()
    result["new_threads"] = sorted({t.name for t in threading.enumerate() if t.is_alive()} - threads)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return result


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("layout", "failing"), [("pp2", 1), ("tp2", 0)])
def test_a_failure_halfway_through_opening_closes_what_was_opened(layout: str, failing: int):
    token = tagged(uuid.uuid4().hex[:8])
    results = check_all_ok(run_processes(_open_with_one_failing_rank, 2, layout, failing, token, timeout_s=150))
    failed, opened = results[failing], results[1 - failing]
    assert failed["error"] == f"rank {failing}: no tracer for dpp"
    assert opened["forward_backward"]
    # The check below means something: while open, the links' rings (PP) or the decision log (TP) are mapped.
    assert opened["mapped_while_open"], opened
    for rank, result in enumerate(results):
        assert result["owned_after"] == [], (rank, result)
        assert result["mapped_after"] == [], (rank, result)
        assert result["new_threads"] == [], (rank, result)
    assert failed["mapped_after_close"] == [], failed  # nothing holds the failed rank's closed channels


def _open_and_close_traced(rank: int, world: int, profile_dir: str, token: str) -> dict:
    with _runtime(rank, world, "pp2", token, profile_dir=profile_dir) as runtime:
        runtime.begin_step(3)
        runtime.tracer.record("probe", "compute", 0.0, 1.0)
    owned = _still_owned(runtime)
    del runtime
    gc.collect()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return {"mapped_after": _mapped_shared_memory(), "owned_after": owned}


@pytest.mark.timeout(180)
def test_leaving_the_block_writes_the_traces_and_closes_the_links(tmp_path: Path):
    """Tracing on: the clock offset collective runs while opening; each rank's trace is written on exit."""
    results = check_all_ok(run_processes(_open_and_close_traced, 2, str(tmp_path), tagged(uuid.uuid4().hex[:8]),
                                         timeout_s=150))
    for result in results:
        assert result == {"mapped_after": [], "owned_after": []}
    traces = sorted(tmp_path.rglob("*.json"))
    assert len(traces) == 2, traces
    for trace in traces:
        document = json.loads(trace.read_text())
        assert [e["name"] for e in document["traceEvents"]] == ["probe"]
        assert document["traceEvents"][0]["args"]["iteration"] == 3
        assert document["metadata"]["schedule"] == "dpp"
