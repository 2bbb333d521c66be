"""The native GPU hop (csrc/cuda_hop.cpp) on a machine without a GPU driver: it builds and imports
(the driver is dlopen'ed at first use), says why it cannot be used, refuses every call with that
reason instead of crashing, and the transport falls back to interprocess events with a warning.
The calls themselves run in tests/gpu/test_transport_gpu.py (flags and events, under
set_sync_debug_mode("error"))."""

import logging

import pytest
import torch

from trainer.transport import _cuda_hop
from trainer.transport.gpu_signals import probe_stream_mem_ops

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this tier checks the machine without a GPU")


def _driver_missing() -> str:
    problem = _cuda_hop.available()
    if not problem:
        pytest.skip("a CUDA driver is installed on this machine (no GPU visible, but libcuda loads)")
    return problem


def test_without_a_driver_the_module_says_why():
    assert "libcuda.so.1" in _driver_missing()


@pytest.mark.parametrize(
    "call",
    [
        lambda: _cuda_hop.flagged_copy(1, 2, 3, 4, 8, 1, 16, 32, 64, 8, 2),
        lambda: _cuda_hop.wait_geq(1, 2, 8, 1),
        lambda: _cuda_hop.write(1, 2, 8, 1),
        lambda: _cuda_hop.copy(1, 2, 8, 16, 4),
        lambda: _cuda_hop.record_event(1, 2, 3),
        lambda: _cuda_hop.wait_event(1, 2, 3),
        lambda: _cuda_hop.primary_context(0),
    ],
)
def test_every_call_raises_the_reason_instead_of_touching_memory(call):
    problem = _driver_missing()
    with pytest.raises(RuntimeError) as info:
        call()
    assert str(info.value) == problem


def test_probe_reports_no_stream_memory_operations_with_a_warning(caplog):
    _driver_missing()
    with caplog.at_level(logging.WARNING, logger="trainer.transport.gpu_signals"):
        assert probe_stream_mem_ops(torch.device("cuda", 0)) is False
    assert "stream memory operations unavailable" in caplog.text and "libcuda" in caplog.text
