"""GpuOpTimer on a real GPU: CUDA-event op times land on the host clock, in order, inside the step."""

from __future__ import annotations

import pytest
import torch

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
