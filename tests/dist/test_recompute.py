"""Activation recompute (``--recompute-*``) really recomputes on CPU, and changes no number.

One process, megatron-core's local spec, dropout ON: megatron's ``CheckpointFunction`` restores the
CPU generator before re-running a forward (the CUDA half is shimmed out on CPU), so recomputed
dropout masks equal the first ones and the losses equal a run without recompute bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.dist.launch import REPO, free_port

# Counts megatron's checkpointed forwards per configuration; prints one JSON line.
SCRIPT = r"""
import json, sys
from megatron.core.tensor_parallel import random as tp_random
from tests.model_flags import model_flags
from trainer.train import TrainHooks, main

calls, losses = {"n": 0}, []
original = tp_random.CheckpointFunction.forward
def counting(ctx, *args, **kwargs):
    calls["n"] += 1
    return original(ctx, *args, **kwargs)
tp_random.CheckpointFunction.forward = staticmethod(counting)
base = model_flags() + "--global-batch-size 8 --micro-batch-size 2 --train-iters 2 --log-interval 100".split()
result = {}
for name, flags in json.loads(sys.argv[1]).items():
    calls["n"], losses = 0, []
    hooks = TrainHooks(after_step=lambda it, reduced: losses.append(reduced["lm loss"]))
    assert main(base + flags, hooks) == 0
    result[name] = {"checkpointed": calls["n"], "losses": losses}
print("RESULT " + json.dumps(result))
"""

CONFIGS = {
    "none": [],
    "selective": ["--recompute-activations"],  # core attention of both layers
    "full-uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "full-block": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
}


@pytest.mark.timeout(300)
def test_recompute_granularities_recompute_what_they_say_and_keep_losses() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CONFIGS)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # 2 iterations x 4 microbatches: one checkpointed call per layer (selective: its core attention),
    # per group of 1 layer (uniform), or for the first layer of the block only (block).
    assert {k: v["checkpointed"] for k, v in result.items()} == {
        "none": 0, "selective": 16, "full-uniform": 16, "full-block": 8}
    for name in CONFIGS:
        assert result[name]["losses"] == result["none"]["losses"], name
