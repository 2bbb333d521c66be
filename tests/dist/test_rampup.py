"""--rampup-batch-size under the pipeline: the microbatch count changes between iterations (CPU, gloo).

The global batch ramps 4 -> 6 -> 8 (--rampup-batch-size 4 2 8, --micro-batch-size 2): iterations of
2, 3 and 4 microbatches. A single-process reference (a plain loop over the microbatches, not the
runtime) sets the losses and gradients; PP=2 under --use-dpp's dpp-zb must match them at every
iteration (tests/dist/test_dpp_equivalence.py's tolerances), and the static 1F1B order stopped after
the first iteration and resumed from its checkpoint (mid-ramp: the consumed samples decide the next
batch) must reproduce the same losses. The LR schedule counts samples, so the losses at iterations
2 and 3 also check that each step advanced it by its own batch.

A ramp may start below the pipeline depth (Megatron-LM's 175b example does under DP > 1): PP=4 with
batches 2 -> 4 -> 6 (micro batch 1: 2, 4 and 6 microbatches) under the runtime's 1F1B (the stand-in for
megatron-core's), dpp and dpp-zb must match their own single-process reference the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.dist.grads import GRAD_RTOL, compare_grads, load_rank_grads
from tests.dist.launch import check_ok, launch

LOSS_RTOL = 1e-5
ITERS = 3  # 18 samples: batches 4 and 6 (10 samples, past the 8-sample ramp), then (18 - 10) // 8 = 1 of 8
ARGS = ["--device", "cpu", "--mock-data", "--model", "gpt", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--make-vocab-size-divisible-by",
        "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--rampup-batch-size", "4", "2", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--lr-warmup-samples", "6",
        "--lr-decay-samples", "100", "--dpp-timeout", "120", "--transport", "gloo"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# 2 -> 6 by 2 over 4 samples (one increment every 2): batches 2, 4, then 6 from 6 consumed samples on.
BELOW_PP = [*ARGS[:ARGS.index("--micro-batch-size")], "--micro-batch-size", "1", "--global-batch-size", "6",
            "--rampup-batch-size", "2", "2", "4", *ARGS[ARGS.index("--hidden-dropout"):]]
PP4 = ["--pipeline-model-parallel-size", "4"]


def _run(out: Path, world: int, train_samples: int, args: list[str], harness: list[str],
         base: list[str] = ARGS) -> list:
    results = launch(["tests.dist.train_harness", "--out", str(out), *harness, "--",
                      *base, "--train-samples", str(train_samples), *args], world, timeout_s=420)
    check_ok(results)
    return results


def _losses(out: Path) -> dict[str, float]:
    return {it: v["lm loss"] for it, v in json.loads((out / "losses_rank0.json").read_text()).items()}


@pytest.mark.timeout(1500)
def test_rampup_under_dpp_matches_reference_and_resumes_mid_ramp(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    _run(ref, 1, 18, [], ["--reference", "--save-init", str(ref / "init.pt"), "--dump-grads", str(ITERS)])
    expected = _losses(ref)
    assert sorted(expected) == ["1", "2", "3"]

    dpp = tmp_path / "dpp"
    results = _run(dpp, 2, 18, [*PP2, "--use-dpp", "--dpp-policy", "dpp-zb"],
                   ["--load-init", str(ref / "init.pt"), "--dump-grads", str(ITERS)])
    # Megatron-LM's iteration line names each iteration's global batch (the last stage logs).
    sizes = [int(s) for s in re.findall(r"global batch size:\s+(\d+)", results[1].output)]
    consumed = [int(s) for s in re.findall(r"consumed samples:\s+(\d+)", results[1].output)]
    assert sizes == [4, 6, 8] and consumed == [4, 10, 18], results[1].output[-3000:]
    for it, value in expected.items():
        assert _losses(dpp)[it] == pytest.approx(value, rel=LOSS_RTOL), f"dpp-zb iteration {it}"
    for it in range(ITERS):  # 2, 3 and 4 microbatches
        worst, problems = compare_grads(load_rank_grads(ref, it)[0], load_rank_grads(dpp, it))
        assert not problems, f"iteration {it}: " + "; ".join(problems[:8])
        assert worst <= GRAD_RTOL

    # Stop after iteration 1 (4 samples consumed, the next batch 6) and resume: the static 1F1B order.
    ckpt = tmp_path / "ckpt"
    _run(tmp_path / "part1", 2, 4, [*PP2, "--save", str(ckpt)], ["--load-init", str(ref / "init.pt")])
    results = _run(tmp_path / "part2", 2, 18, [*PP2, "--load", str(ckpt)], [])
    resumed = {**_losses(tmp_path / "part1"), **_losses(tmp_path / "part2")}
    assert sorted(_losses(tmp_path / "part2")) == ["2", "3"]  # resumed at iteration 1, not from scratch
    assert [int(s) for s in re.findall(r"global batch size:\s+(\d+)", results[1].output)] == [6, 8]
    for it, value in expected.items():
        assert resumed[it] == pytest.approx(value, rel=LOSS_RTOL), f"resumed iteration {it}"


@pytest.mark.timeout(1500)
def test_ramp_starting_below_the_pipeline_depth_matches_reference(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    _run(ref, 1, 12, [], ["--reference", "--save-init", str(ref / "init.pt"), "--dump-grads", str(ITERS)],
         base=BELOW_PP)
    expected = _losses(ref)
    assert sorted(expected) == ["1", "2", "3"]
    for name, flags in (("1f1b", []), ("dpp", ["--use-dpp", "--dpp-policy", "dpp"]),
                        ("dpp-zb", ["--use-dpp", "--dpp-policy", "dpp-zb"])):
        out = tmp_path / name
        results = _run(out, 4, 12, [*PP4, *flags, "--metrics-dir", str(out / "metrics")],
                       ["--load-init", str(ref / "init.pt"), "--dump-grads", str(ITERS)], base=BELOW_PP)
        for rank in range(4):  # --metrics-dir counts each iteration's own batch
            records = json.loads((out / "metrics" / f"metrics_rank{rank:05d}.json").read_text())["iterations"]
            assert [(r["global_batch_size"], r["num_microbatches"], r["tokens"]) for r in records] == \
                [(2, 2, 32), (4, 4, 64), (6, 6, 96)]
        sizes = [int(s) for s in re.findall(r"global batch size:\s+(\d+)", results[3].output)]
        assert sizes == [2, 4, 6], results[3].output[-3000:]
        for it, value in expected.items():
            assert _losses(out)[it] == pytest.approx(value, rel=LOSS_RTOL), f"{name} iteration {it}"
        for it in range(ITERS):  # 2, 4 and 6 microbatches over 4 stages
            worst, problems = compare_grads(load_rank_grads(ref, it)[0], load_rank_grads(out, it))
            assert not problems, f"{name} iteration {it}: " + "; ".join(problems[:8])
            assert worst <= GRAD_RTOL
