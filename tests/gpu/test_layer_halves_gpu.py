"""trainer.measure.layer_halves on a GPU: the attention and MLP halves of one layer of the trainer's
model, timed from their kernels; the share the benchmark's ``--resplit auto`` places half layers by.

    python -m pytest -m gpu tests/gpu/test_layer_halves_gpu.py -s
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.model_flags import GPU_SMALL, model_flags

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(300)
def test_layer_halves_measures_both_halves_of_the_trainers_layer() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    flags = [*model_flags(**GPU_SMALL), "--micro-batch-size", "2", "--global-batch-size", "8",
             "--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "2.5,1.5", "--bf16"]
    done = subprocess.run([sys.executable, "-m", "trainer.measure.layer_halves", "--reps", "5", "--", *flags],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    print(measured)
    forward_a, backward_a = measured["ms"]["attention"]
    forward_m, backward_m = measured["ms"]["mlp"]
    assert min(forward_a, backward_a, forward_m, backward_m) > 0, measured
    share = (forward_a + backward_a) / (forward_a + backward_a + forward_m + backward_m)
    # the printed ms are rounded to 0.1 µs; the share is computed from the unrounded times
    assert measured["attention_share"] == pytest.approx(share, rel=1e-2) and 0 < share < 1, measured
