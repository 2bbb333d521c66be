"""Split backward (dpp-zb) with Transformer Engine's layers (``--transformer-impl transformer_engine``):
the W steps run TE's own deferred weight GEMMs (trainer/pipeline/split_backward_te.py), youngest first,
and the run trains to megatron-core's 1F1B losses with the gradients of the unsplit DPP runtime.

Four runs from the same seed and data, dropout 0: megatron-core's own 1F1B (interleaved at v = 2), DPP
dpp (eager, unsplit), DPP dpp-zb eager (--dpp-eager) and DPP dpp-zb as --use-dpp runs it by default,
from the slot graphs (each slot's I copies what its W reads out of the shared backward pool:
trainer/pipeline/graph_operands.py). fp32 at one chunk per stage: dpp-zb splits the last stage only
(stage 0's input gradients feed nobody) and runs its W youngest first -- the order TE's own per-module
FIFO could not serve; bf16 at v = 2: every stage and chunk splits, I taking its gradient from downstream.
Checked: every splitting stage's TE linears are installed (4 per layer: linear_qkv and linear_fc1 are
te.LayerNormLinear, linear_proj and linear_fc2 te.Linear) and, eager, every one of their weight GEMMs in
every microbatch went to a W step, none ran inside I; graphed, every training forward replayed; both
dpp-zb runs' losses equal megatron-core's (fp32: to the rounding of another summation order of the
microbatches' weight gradients; bf16: to bf16 rounding); every gradient they dumped -- TE's weights and
GEMM-fused biases included, which a lost, doubled or overwritten W would change by the whole of a
microbatch's share -- equals the unsplit DPP run's. Two ranks on 2 GPUs
(NCCL), or sharing one over gloo (where the first run is the trainer's own 1F1B order instead of
megatron-core's schedule). Skipped without an importable Transformer Engine (scripts/te/build.sh
builds one; docs/transformer_engine.md).

    python -m pytest -m gpu tests/gpu/test_te_split_gpu.py -s
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.gpu.same_run import grad_dumps, train
from tests.gpu.test_te_gpu import ITERS, TE_GPT, M, _needs_te

pytestmark = pytest.mark.gpu

LAYERS_PER_STAGE = 2  # GPU_SMALL's 4 layers over PP=2
TE_LINEARS_PER_LAYER = 4
INSTALLED = re.compile(r"stage (\d+): split backward defers the weight GEMMs of (\d+) megatron-core linear\(s\) "
                       r"and (\d+) Transformer Engine linear\(s\) to W")
DEFERRED = re.compile(r"stage (\d+): split backward: (\d+) Transformer Engine weight GEMM\(s\) deferred to W, "
                      r"(\d+) run in their backward")
REPLAYED = re.compile(r"stage (\d+) chunk (\d+): (\d+) training forward\(s\) replayed from CUDA graphs, (\d+) eager")


def _assert_grads_close(want_dir: Path, got_dir: Path, rel: float, rel_after_step: float) -> int:
    """Every dumped gradient of ``got_dir`` within ``rel`` of ``want_dir``'s in relative norm (the first
    iteration's), ``rel_after_step`` from the second on; returns how many tensors were compared. Why two
    bounds: W's order changes only the summation order of the microbatches' weight gradients, so the first
    iteration's gradients differ by rounding; the next iteration's are taken at weights that one optimizer
    step moved from those, and Adam's first step (about lr times the gradient's sign) turns the rounding
    of a near-zero gradient into a whole lr (fp32, 2xH200: 8.8e-5 of the embedding gradient's norm). A lost
    or doubled W moves a weight's gradient by a microbatch's share, far above either bound."""
    dumps = grad_dumps(want_dir)
    assert dumps and dumps == grad_dumps(got_dir)
    compared = 0
    for dump in dumps:
        want, got = torch.load(want_dir / dump), torch.load(got_dir / dump)
        assert sorted(got) == sorted(want), dump
        bound = rel if dump.endswith("_it0.pt") else rel_after_step
        for name, (grad, *_) in want.items():
            diff = (got[name][0] - grad).norm().item()
            assert diff <= bound * grad.norm().item() + 1e-12, \
                f"{dump} {name}: |diff| {diff:.3e}, |grad| {grad.norm():.3e} (bound {bound:g} of |grad|)"
            compared += 1
    return compared


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("precision", "chunks"), [("fp32", 1), ("bf16", 2)])
def test_te_split_backward_trains_like_megatron_1f1b(tmp_path: Path, precision: str, chunks: int) -> None:
    _needs_te()
    gpt = TE_GPT + (["--distributed-backend", "gloo"] if torch.cuda.device_count() < 2 else [])
    gpt += ["--bf16"] if precision == "bf16" else []
    gpt += ["--num-layers-per-virtual-pipeline-stage", str(LAYERS_PER_STAGE // chunks)] if chunks > 1 else []
    splitting = {1} if chunks == 1 else {0, 1}  # dpp-zb leaves stage 0 unsplit at v = 1
    _, megatron = train(tmp_path / "1f1b", 2, ["--dump-grads", "2", "--", *gpt], last_rank=1)
    _, unsplit = train(tmp_path / "dpp", 2, ["--dump-grads", "2", "--", *gpt, "--use-dpp", "--dpp-policy", "dpp",
                                             "--dpp-eager"], last_rank=1)
    results, split = train(tmp_path / "dpp-zb", 2, ["--dump-grads", "2", "--", *gpt, "--use-dpp", "--dpp-policy",
                                                    "dpp-zb", "--dpp-eager"], last_rank=1)
    graphed_results, graphed = train(tmp_path / "dpp-zb-graphs", 2, ["--dump-grads", "2", "--", *gpt, "--use-dpp",
                                                                    "--dpp-policy", "dpp-zb"], last_rank=1)
    logs = "".join(r.output for r in results)
    installed = {int(m[1]): (int(m[2]), int(m[3])) for m in INSTALLED.finditer(logs)}
    deferred = {int(m[1]): (int(m[2]), int(m[3])) for m in DEFERRED.finditer(logs)}
    print("installed (megatron-core, TE linears) per stage:", installed)
    print("TE weight GEMMs (deferred to W, run in I) per stage, eager:", deferred)
    te_linears = LAYERS_PER_STAGE * TE_LINEARS_PER_LAYER
    assert {s: te for s, (_, te) in installed.items()} == dict.fromkeys(splitting, te_linears), installed
    assert deferred == dict.fromkeys(splitting, (ITERS * M * te_linears, 0)), deferred
    assert "replayed from CUDA graphs" not in logs  # --dpp-eager
    graphed_logs = "".join(r.output for r in graphed_results)
    replayed = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for m in REPLAYED.finditer(graphed_logs)}
    print("replayed/eager forwards per (stage, chunk), graphed:", replayed)
    assert replayed == {(st, c): (ITERS * M, 0) for st in (0, 1) for c in range(chunks)}, replayed
    pools = [(int(m[1]), int(m[2])) for m in re.finditer(r"graphed split backward: (\d+) W\(s\) read their operands "
                                                       r"where I left them, (\d+) slot evacuation", graphed_logs)]
    # TE's slots leave W's operands in the backward pool (graph_operands.copies_wait): W's read them in place,
    # on the split stage (v = 1) or on both (v = 2: every stage splits its later chunk).
    assert len(pools) == chunks and all(direct > 0 for direct, _ in pools), pools
    graphed_installed = {int(m[1]): (int(m[2]), int(m[3])) for m in INSTALLED.finditer(graphed_logs)}
    assert graphed_installed == installed, graphed_installed
    names = set(torch.load(next((tmp_path / "dpp-zb").glob("grads_rank0_it*.pt"))))
    assert any("linear_qkv.layer_norm_weight" in n for n in names), sorted(names)[:20]  # TE's spec trained
    rel = 1e-4 if precision == "fp32" else 2e-2
    print(f"{precision}, v={chunks}: megatron-core, DPP dpp (eager), DPP dpp-zb (eager, TE's deferred weight GEMMs), "
          "DPP dpp-zb (graphed)")
    for it in sorted(megatron, key=int):
        print(it, megatron[it]["lm loss"], unsplit[it]["lm loss"], split[it]["lm loss"], graphed[it]["lm loss"])
        assert split[it]["lm loss"] == pytest.approx(megatron[it]["lm loss"], rel=rel), f"iteration {it}"
        assert graphed[it]["lm loss"] == pytest.approx(megatron[it]["lm loss"], rel=rel), f"iteration {it}, graphed"
    bounds = (1e-5, 1e-3) if precision == "fp32" else (2e-2, 2e-2)
    for run in ("dpp-zb", "dpp-zb-graphs"):
        compared = _assert_grads_close(tmp_path / "dpp", tmp_path / run, *bounds)
        print(f"{compared} gradient tensors of {run} equal the unsplit run's")


@pytest.mark.timeout(900)
def test_te_half_layer_boundary_trains_like_whole_layers(tmp_path: Path) -> None:
    """--pipeline-stage-layers 2.5,1.5 with Transformer Engine's layers (fp32): stage 0 ends after layer
    2's attention (TE's fused-norm QKV and its projection), stage 1 starts with that layer's MLP (TE's
    fused-norm fc1). Graphed dpp-zb on the half split trains like eager dpp on the same split (losses,
    and every gradient), every forward replays, and layer 2's MLP is trained on stage 1. Not compared
    with the whole-layer split: megatron-core seeds each pipeline rank's initialisation apart, so moving
    a half to another stage starts it from other weights (the CPU equivalence tests load one set of
    weights into every split instead: tests/dist/test_dpp_equivalence.py -k halves)."""
    _needs_te()
    gpt = TE_GPT + (["--distributed-backend", "gloo"] if torch.cuda.device_count() < 2 else [])
    halves = ["--pipeline-stage-layers", "2.5,1.5"]
    _, unsplit = train(tmp_path / "dpp", 2, ["--dump-grads", "2", "--", *gpt, *halves, "--use-dpp", "--dpp-policy",
                                             "dpp", "--dpp-eager"], last_rank=1)
    results, graphed = train(tmp_path / "dpp-zb-graphs", 2, ["--dump-grads", "2", "--", *gpt, *halves, "--use-dpp",
                                                            "--dpp-policy", "dpp-zb"], last_rank=1)
    logs = "".join(r.output for r in results)
    assert "layers 2.5/1.5 |" in logs, logs[-2000:]
    replayed = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for m in REPLAYED.finditer(logs)}
    assert replayed == {(st, 0): (ITERS * M, 0) for st in (0, 1)}, replayed
    for it in sorted(unsplit, key=int):
        print(it, unsplit[it]["lm loss"], graphed[it]["lm loss"])
        assert graphed[it]["lm loss"] == pytest.approx(unsplit[it]["lm loss"], rel=1e-4), f"iteration {it}"
    held = {".".join(name.split(".")[2:4]) for name in torch.load(tmp_path / "dpp-zb-graphs" / "grads_rank1_it0.pt")
            if name.startswith("decoder.layers.")}
    assert "2.mlp" in held and "2.self_attention" not in held, sorted(held)  # the MLP half of layer 2
    compared = _assert_grads_close(tmp_path / "dpp", tmp_path / "dpp-zb-graphs", 1e-5, 1e-3)
    print(f"{compared} gradient tensors of graphed dpp-zb on 2.5/1.5 equal eager dpp's")


@pytest.mark.timeout(600)
def test_te_lazy_operand_copies_train_like_copies_in_i(tmp_path: Path) -> None:
    """--dpp-graph-operand-copies lazy with Transformer Engine's layers (fp32, v=1): the split stage's W
    reads the deferred GEMMs' operands where its I left them in the backward pool unless another backward
    graph replays first (trainer/pipeline/graph_operands.py). Against the same graphed run copying inside
    every I (in-i): equal losses and gradients, and W's read in place. The check ``auto`` waits for before it
    leaves TE's operands in the pool as it does megatron-core's."""
    _needs_te()
    gpt = TE_GPT + (["--distributed-backend", "gloo"] if torch.cuda.device_count() < 2 else [])
    runs = {}
    for mode in ("in-i", "lazy"):
        results, runs[mode] = train(tmp_path / mode, 2, ["--dump-grads", "2", "--", *gpt, "--use-dpp", "--dpp-policy",
                                                         "dpp-zb", "--dpp-graph-operand-copies", mode], last_rank=1)
        logs = "".join(r.output for r in results)
        pools = [(int(m[1]), int(m[2])) for m in re.finditer(r"graphed split backward: (\d+) W\(s\) read their "
                                                             r"operands where I left them, (\d+) slot evacuation", logs)]
        print(mode, "(direct W, evacuations) per split stage:", pools)
        assert (pools == []) if mode == "in-i" else (len(pools) == 1 and pools[0][0] > 0), (pools, logs[-3000:])
    for it in sorted(runs["in-i"], key=int):
        assert runs["lazy"][it]["lm loss"] == pytest.approx(runs["in-i"][it]["lm loss"], rel=1e-6), f"iteration {it}"
    compared = _assert_grads_close(tmp_path / "in-i", tmp_path / "lazy", 1e-6, 1e-5)
    print(f"{compared} gradient tensors of lazy copies equal copies in I")
