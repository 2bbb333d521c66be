"""With Transformer Engine's layers (``--transformer-impl transformer_engine``, megatron-core's
TE layer spec): megatron-core's own 1F1B, the DPP runtime eager and the DPP runtime replaying its slot
graphs train to the same losses from the same seed and data, and the graphed run really replays.

Dropout 0. In fp32 TE runs its unfused attention, and the graphed and eager DPP runs execute the same
kernels on the same data: their losses and gradients agree to rounding; against megatron-core's 1F1B
the DPP run accumulates the microbatches' weight gradients in another order, so its losses agree to
fp32 rounding of that sum. In bf16 TE runs its fused (cuDNN) attention, whose capture needs the tracker
states registered with each slot graph (trainer/pipeline/graph_rng.py) and whose backward may pick
non-deterministic algorithms: losses agree to bf16 rounding.
Split backward (dpp-zb) with TE's layers: tests/gpu/test_te_split_gpu.py. Two ranks on 2 GPUs (NCCL), or sharing one over gloo (where the first run is the
trainer's own 1F1B order instead of megatron-core's schedule). Skipped without an importable Transformer Engine
(scripts/te/build.sh builds one; docs/transformer_engine.md).

    python -m pytest -m gpu tests/gpu/test_te_gpu.py -s
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.gpu.same_run import assert_same_grads, assert_same_losses, train
from tests.model_flags import GPU_SMALL, model_flags

pytestmark = pytest.mark.gpu

ITERS = 4
M = 8
TE_GPT = [*model_flags(**GPU_SMALL), "--transformer-impl", "transformer_engine", "--micro-batch-size", "2",
          "--global-batch-size", str(2 * M), "--pipeline-model-parallel-size", "2", "--lr", "1e-3",
          "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
          "--dpp-timeout", "60", "--log-interval", "1", "--no-batch-p2p-sync"]
REPLAYED = re.compile(r"stage (\d+) chunk (\d+): (\d+) training forward\(s\) replayed from CUDA graphs, (\d+) eager")


def _needs_te() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # an installed TE whose libraries do not load is as absent as none
        pytest.skip(f"Transformer Engine does not import: {e}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_te_layers_under_megatron_1f1b_dpp_and_dpp_graphs(tmp_path: Path, precision: str) -> None:
    _needs_te()
    # On one GPU both ranks share it over gloo, where the trainer runs its own 1F1B policy in place of
    # megatron-core's schedule (which needs NCCL): then the first run is that static order.
    gpt = TE_GPT + (["--distributed-backend", "gloo"] if torch.cuda.device_count() < 2 else [])
    gpt += ["--bf16"] if precision == "bf16" else []
    _, megatron = train(tmp_path / "1f1b", 2, ["--dump-grads", "2", "--", *gpt], last_rank=1)
    dpp = [*gpt, "--use-dpp", "--dpp-policy", "dpp"]
    _, eager = train(tmp_path / "eager", 2, ["--dump-grads", "2", "--", *dpp, "--dpp-eager"], last_rank=1)
    results, graphed = train(tmp_path / "graphed", 2, ["--dump-grads", "2", "--", *dpp, "--dpp-cuda-graphs"],
                             last_rank=1)
    logs = "".join(r.output for r in results)
    # TE's spec fuses the pre-attention norm into the QKV projection (linear_qkv.layer_norm_weight);
    # megatron-core's local spec has input_layernorm.weight: the dumps say which layers trained.
    names = set(torch.load(next((tmp_path / "1f1b").glob("grads_rank0_it*.pt"))))
    assert any("linear_qkv.layer_norm_weight" in n for n in names), sorted(names)[:20]
    counts = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for m in REPLAYED.finditer(logs)}
    print("replayed/eager forwards per (stage, chunk):", counts)
    assert counts == {(s, 0): (ITERS * M, 0) for s in range(2)}, counts
    rel = 1e-4 if precision == "fp32" else 2e-2
    print(f"{precision}: megatron-core 1F1B, DPP eager, DPP graphed")
    for it in sorted(megatron, key=int):
        print(it, megatron[it]["lm loss"], eager[it]["lm loss"], graphed[it]["lm loss"])
        assert eager[it]["lm loss"] == pytest.approx(megatron[it]["lm loss"], rel=rel), f"iteration {it}"
    if precision == "fp32":
        assert_same_losses(eager, graphed)
        assert_same_grads(tmp_path / "eager", tmp_path / "graphed")
    else:
        for it in sorted(eager, key=int):
            assert graphed[it]["lm loss"] == pytest.approx(eager[it]["lm loss"], rel=5e-3), f"iteration {it}"


TE_BERT = [*[a for a in TE_GPT if a not in ("--vocab-size", "1000")], "--model", "bert", "--vocab-size", "128",
           "--make-vocab-size-divisible-by", "64", "--bf16"]


@pytest.mark.timeout(600)
def test_te_bert_under_megatron_1f1b_and_the_use_dpp_default(tmp_path: Path) -> None:
    """BERT with TE's layers (megatron-core's BERT TE spec: padding masks through TE's attention), bf16:
    megatron-core's 1F1B and what --use-dpp alone runs -- dpp-zb from the slot graphs, each replay
    filling its slot's mask buffer -- train to the same losses (bf16 rounding), every forward replayed."""
    _needs_te()
    bert = TE_BERT + (["--distributed-backend", "gloo"] if torch.cuda.device_count() < 2 else [])
    _, megatron = train(tmp_path / "1f1b", 2, ["--dump-grads", "1", "--", *bert], last_rank=1)
    results, default = train(tmp_path / "default", 2, ["--dump-grads", "1", "--", *bert, "--use-dpp"], last_rank=1)
    logs = "".join(r.output for r in results)
    names = set(torch.load(next((tmp_path / "default").glob("grads_rank0_it*.pt"))))
    assert any("linear_qkv.layer_norm_weight" in n for n in names), sorted(names)[:20]  # TE's spec trained
    assert "schedule dpp-zb" in logs and "graphs: --use-dpp's default" in logs, logs[-3000:]
    counts = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for m in REPLAYED.finditer(logs)}
    print("replayed/eager forwards per (stage, chunk):", counts)
    assert counts == {(s, 0): (ITERS * M, 0) for s in range(2)}, counts
    print("bf16 BERT: megatron-core 1F1B, --use-dpp (graphed dpp-zb)")
    for it in sorted(megatron, key=int):
        print(it, megatron[it]["lm loss"], default[it]["lm loss"])
        assert default[it]["lm loss"] == pytest.approx(megatron[it]["lm loss"], rel=2e-2), f"iteration {it}"
