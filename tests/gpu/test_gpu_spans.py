"""GpuOpTimer on a real GPU: CUDA-event op times land on the host clock, in order, inside the step."""

from __future__ import annotations

import pytest
import torch

from tests.model_flags import model_flags
from trainer.profiling.gpu_spans import GpuOpTimer
from trainer.profiling.tracer import now_us

pytestmark = pytest.mark.gpu


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def record(self, name, cat, start_us, end_us, tid="compute", **args) -> None:
        self.events.append((name, cat, start_us, end_us, tid, args))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_spans_time_each_op_on_the_host_clock() -> None:
    device = torch.device("cuda", 0)
    a = torch.randn(4096, 4096, device=device)
    timer, recorder = GpuOpTimer(device), _Recorder()
    timer.begin_step()
    host_start = now_us()
    for name in ("F0.c0", "B0.c0"):
        with timer.around(name, microbatch=0, chunk=0):
            for _ in range(20):
                a = a @ a / a.norm()  # ~ms of GPU work the host does not wait for
    timer.end_step(recorder)
    host_end = now_us()
    assert [e[0] for e in recorder.events] == ["F0.c0", "B0.c0"]
    (_, cat, s0, e0, tid, args), (_, _, s1, e1, _, _) = recorder.events
    assert cat == "gpu" and tid == "gpu" and args == {"microbatch": 0, "chunk": 0}
    assert 0 < e0 - s0 and 0 < e1 - s1 and e0 <= s1 + 1.0  # in order on one stream
    assert host_start - 2000 <= s0 and e1 <= host_end + 2000  # on the host clock, inside the step


# Stage 0 holds 5 of 6 layers, so stage 1's host queues each forward (its activation's header came
# when stage 0 *queued* the producing forward) long before the activation exists on its GPU.
SKEWED = [*model_flags(device="cuda", layers=6, hidden=1024, heads=8, seq=512, max_position=512, vocab=1000),
          "--decoder-first-pipeline-num-layers", "5", "--micro-batch-size", "2",
          "--global-batch-size", "16", "--pipeline-model-parallel-size", "2", "--lr", "1e-4", "--train-iters", "3",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--use-dpp", "--dpp-policy", "dpp",
          "--dpp-eager", "--dpp-timeout", "60", "--log-interval", "1"]
CLOCK_SLACK_US = 300.0
"""Two processes' GPU spans, each placed on the host clock by its own reference event."""


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_an_ops_gpu_span_opens_after_its_input_was_produced(tmp_path) -> None:
    """The stream's wait for a payload still in flight is queued before the op's start event (the
    runtime reads the input message first, trainer/pipeline/dpp.py _queue_input_wait), so a GPU span
    is the op's run, not its wait: over the same-node GPU transport, no forward on stage 1 opens
    before stage 0's forward of that microbatch ended, no backward on stage 0 before stage 1's, and
    the critical path finds no wait inside an op span. (Before, stage 1's spans opened at once and
    held the whole wait: 4-GPU traces taken that way summed ~11% more op time than the step.)"""
    from tests.dist.launch import check_ok, launch
    from trainer.profiling.critical_path import analyse, collect_spans
    from trainer.profiling.loading import load_rank_traces
    from trainer.profiling.merge import merge_traces

    profile = tmp_path / "prof"
    check_ok(launch(["trainer.train", *SKEWED, "--profile-dir", str(profile)], 2, timeout_s=240))
    loaded = load_rank_traces(profile)
    by_iteration = collect_spans(merge_traces(loaded.traces, loaded.missing_ranks, loaded.problems), "gpu")
    assert len(by_iteration) >= 2, sorted(by_iteration)
    early = []
    for iteration, stages in sorted(by_iteration.items()):
        index = {(o.stage, o.op, o.microbatch): o for ops in stages.values() for o in ops}
        pairs = [(o, index[(0, "F", o.microbatch)]) for o in stages[1] if o.op == "F"]
        pairs += [(o, index[(1, "B", o.microbatch)]) for o in stages[0] if o.op == "B"]
        assert len(pairs) == 16, (iteration, len(pairs))  # 8 microbatches, a forward and a backward each
        early += [(iteration, op.label, round(producer.end - op.start)) for op, producer in pairs
                  if op.start < producer.end - CLOCK_SLACK_US]
        report = analyse(stages, iteration)  # each path op may be off by the two clocks' slack, no more
        assert report.inside_wait_ms < len(report.path) * CLOCK_SLACK_US / 1000.0, (iteration, report.inside_wait_ms)
    assert not early, f"GPU spans opened before their input existed (iteration, op, µs early): {early[:8]}"
