"""One training rank (``python -m trainer.train`` with the same arguments) that also reports where its
peak memory is reached: right after its CUDA graphs are captured it prints one ``GRAPH_MEM`` line (peak
reserved and allocated so far, current reserved and allocated) and resets the peak counters, so the
run's metrics file (``--metrics-dir``) then holds the steady-state peak of the training steps alone.

    python3 -m scripts.device.graph_mem_probe <trainer.train arguments>

``GRAPH_MEM_KEEP_WARM_UP_CACHE=1``: the capture as it was before each chunk's warm-up cache was
released ahead of its captures (only the release after all captures is kept), for a before/after
comparison in one call (scripts/device/mem_1gpu.py --graph-mem runs both).
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

from trainer.pipeline import cuda_graphs, stage_graphs

GIB = 2**30


def _keep_warm_up_cache() -> None:
    release = cuda_graphs.release_cached_blocks

    def release_after_all_captures_only(device) -> None:  # noqa: ANN001
        if sys._getframe(1).f_code.co_name == "capture_chunk_graphs":
            release(device)

    cuda_graphs.release_cached_blocks = release_after_all_captures_only


def _report_after_capture() -> None:
    capture = stage_graphs.capture_chunk_graphs

    def capture_and_report(*args, **kwargs):
        graphs = capture(*args, **kwargs)
        device = torch.cuda.current_device()
        print(f"GRAPH_MEM rank {os.environ.get('RANK', '?')} after capture"
              f"{' (warm-up cache kept)' if os.environ.get('GRAPH_MEM_KEEP_WARM_UP_CACHE') == '1' else ''}: "
              f"peak reserved {torch.cuda.max_memory_reserved(device) / GIB:.2f} GiB, "
              f"peak allocated {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB; "
              f"now reserved {torch.cuda.memory_reserved(device) / GIB:.2f} GiB, "
              f"allocated {torch.cuda.memory_allocated(device) / GIB:.2f} GiB", flush=True)
        torch.cuda.reset_peak_memory_stats(device)  # from here on: the steady state's peak
        return graphs

    stage_graphs.capture_chunk_graphs = capture_and_report


def main() -> None:
    if os.environ.get("GRAPH_MEM_KEEP_WARM_UP_CACHE") == "1":
        _keep_warm_up_cache()
    _report_after_capture()
    # trainer.pipeline.runtime imports capture_chunk_graphs inside capture_graphs, so it gets the wrapper.
    sys.argv[0] = "trainer.train"
    runpy.run_module("trainer.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
