"""--dpp-cuda-graphs on CUDA: the same losses and gradients as the eager DPP run.

Two pipeline stages; on a one-GPU machine both ranks share the GPU (--distributed-backend gloo, as
the DPP runtime's CUDA IPC path allows). fp32 and dropout 0, so graph replays and eager ops run the
same kernels on the same data: losses and gradients must agree to rounding (GPT and BERT). The graphed
run must really replay (its log counts the forwards each stage replayed) -- a run that silently fell
back to eager everywhere would pass the comparison and prove nothing. With dropout 0.1 (Megatron-LM's
default) the graphed run repeats itself from the same seed and stays close to the eager run, whose
masks differ (tests/gpu/test_graph_rng.py checks the masks themselves).

    python -m pytest -m gpu tests/gpu/test_dpp_cuda_graphs.py -s
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.gpu.same_run import assert_same_grads, assert_same_losses, grad_dumps, train
from tests.model_flags import GPU_SMALL, model_flags

pytestmark = pytest.mark.gpu

ITERS = 3
M = 8
GPT = [*model_flags(**GPU_SMALL), "--micro-batch-size", "2", "--global-batch-size", str(2 * M),
       "--pipeline-model-parallel-size", "2", "--lr", "1e-3", "--train-iters", str(ITERS),
       "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--use-dpp",
       "--dpp-timeout", "60", "--log-interval", "1"]
FITTED = re.compile(r"stage (\d+): held cap fitted to memory: (\d+) slot\(s\) \(its 1F1B bound (\d+), at most (\d+)\)")
REPLAYED = re.compile(r"stage (\d+) chunk (\d+): (\d+) training forward\(s\) replayed from CUDA graphs, (\d+) eager")
POOL_USE = re.compile(r"graphed split backward: (\d+) W\(s\) read their operands where I left them, (\d+) slot "
                      r"evacuation\(s\) copied them out of the backward pool first, (\d+) W\(s\) ran early")


def _run(out: Path, extra: list[str], model: list[str] = GPT) -> tuple[list, dict]:
    args = [*model, *extra]
    if torch.cuda.device_count() < 2:
        args += ["--distributed-backend", "gloo"]
    return train(out, 2, ["--dump-grads", "2", "--", *args], last_rank=1)


VARLEN = ["--variable-seq-lengths", "--mock-seq-len-dist", "lognormal:0.6", "--seq-length-divisible-by", "32"]


ZB = ["--dpp-policy", "dpp-zb"]
DPP = ["--dpp-policy", "dpp"]  # explicit: the default (auto) picks dpp-zb with graphs and dpp without
EAGER = ["--dpp-eager"]  # the eager bar: --use-dpp alone replays from CUDA graphs where they can run


@pytest.mark.timeout(700)
@pytest.mark.parametrize("chunks, varlen, extra, both", [
    (1, False, [], DPP), (2, False, [], DPP), (1, True, [], DPP),
    (1, False, ["--recompute-activations"], DPP),
    (1, False, ["--dpp-max-queued-ops", "1"], DPP),
    (1, False, ["--dpp-recompute-slots", "1,1"], DPP),
    (1, False, [], ZB), (2, False, [], ZB), (1, True, [], ZB), (1, False, ["--dpp-recompute-slots", "1,1"], ZB),
    (2, False, ["--dpp-graph-evacuation-sets", "1"], ZB)],
    ids=["v1", "v2", "v1-varlen", "v1-recompute", "v1-queued1", "v1-recompute-slot",
         "zb-v1", "zb-v2", "zb-v1-varlen", "zb-v1-recompute-slot", "zb-v2-one-set"])
def test_graphed_dpp_equals_eager_dpp(tmp_path: Path, chunks: int, varlen: bool, extra: list[str],
                                      both: list[str]) -> None:
    """v1-varlen: microbatches of 32/64/96/128 tokens, each slot holding a graph pair per length.
    v1-recompute: the graphed run recomputes the core attention in its backward graphs
    (--recompute-activations); the eager run does not -- recompute must change no number.
    v1-queued1: the graphed run's hosts decide with at most one op unfinished on their GPU
    (--dpp-max-queued-ops 1): a timing change only, so no number may move.
    v1-recompute-slot: one graph slot per stage recomputes the core attention, the other keeps it
    (--dpp-recompute-slots 1,1: stage 0 has 2 slots, stage 1 one) -- again no number may move.
    zb-*: both runs use --dpp-policy dpp-zb (split backward): the graphed run's slots hold F, I and W
    graphs, each deferred W replaying its slot's graph (stage 1 also holds 2 slots: dpp-zb's held
    cap is stage 0's 1F1B bound); at v = 1 stage 0 runs whole backwards (F and B graphs).
    zb-v2-one-set: the stage's slots share one evacuation set (--dpp-graph-evacuation-sets 1), so a slot
    whose operands find it taken runs its W early, before the backward that needed the pool."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    layout = [] if chunks == 1 else ["--num-layers-per-virtual-pipeline-stage", "1"]
    layout += (VARLEN if varlen else []) + both
    _, eager = _run(tmp_path / "eager", [*layout, *EAGER])
    graph_flags = ["--dpp-cuda-graphs", *extra]
    results, graphed = _run(tmp_path / "graphed", [*layout, *graph_flags])
    counts = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for r in results for m in REPLAYED.finditer(r.output)}
    print("replayed/eager forwards per (stage, chunk):", counts)
    # Every training forward of every chunk replays (a stage's in-flight cap is each chunk's number of slots).
    assert counts == {(s, c): (ITERS * M, 0) for s in range(2) for c in range(chunks)}, counts
    if "--dpp-recompute-slots" in extra:
        logs = "".join(r.output for r in results)
        slots = {int(m[1]): int(m[2]) for m in re.finditer(r"stage (\d+): CUDA graphs for chunk\(s\) \[0\], (\d+) "
                                                          r"slot\(s\) \(1 recomputing", logs)}
        # stage 0 holds its 1F1B bound, 2; stage 1 its own (1) under dpp, and under dpp-zb what the held cap's
        # fit to memory gave it (1 or 2: trainer/pipeline/stage_graphs.py), one of them recomputing each time
        fitted = {int(m[1]): int(m[2]) for m in FITTED.finditer(logs)}
        assert slots == {0: 2, 1: fitted.get(1, 1) if both == ZB else 1}, (slots, fitted, logs[-3000:])
    if both == ZB:
        logs = "".join(r.output for r in results)
        split_stages = set(re.findall(r"stage (\d+): CUDA graphs[^\n]*F, I and W graphs: split backward", logs))
        # At v = 1 stage 0 runs whole backwards (DynamicOptions.split_first_stage): F and B graphs there.
        assert split_stages == ({"1"} if chunks == 1 else {"0", "1"}), logs[-3000:]
        # W's operands are copied out of the backward pool only when another backward graph replays first.
        pools = [(int(m[1]), int(m[2]), int(m[3])) for m in POOL_USE.finditer(logs)]
        print("graphed split backward: (direct W, evacuations, early W) per split stage:", pools)
        assert len(pools) == len(split_stages) and sum(direct for direct, _, _ in pools) > 0, logs[-3000:]
        if "--dpp-graph-evacuation-sets" in extra:
            assert sum(early for _, _, early in pools) > 0, pools  # the one set was taken at times
            assert "W's operands evacuated into 1 set(s)" in logs, logs[-3000:]
    assert_same_losses(eager, graphed)
    assert len(grad_dumps(tmp_path / "eager")) == 4  # 2 ranks x 2 iterations (--dump-grads 2)
    assert_same_grads(tmp_path / "eager", tmp_path / "graphed")


@pytest.mark.timeout(700)
@pytest.mark.parametrize("distopt", [False, True], ids=["overlap", "overlap-distopt"])
def test_graphed_dpp_zb_with_overlapped_dp_reduction_equals_eager(tmp_path: Path, distopt: bool) -> None:
    """PP=2 x DP=2 with --overlap-grad-reduce: a replayed backward runs no DDP hook, so the runtime
    starts each chunk's reduction after its last B or W (trainer/pipeline/grad_sync.py), queued on the
    stream behind the replay. Against eager DPP without the overlap: equal losses, and (without the
    distributed optimizer, whose reduce-scatter leaves each rank only its shard) equal gradients.
    Needs 4 GPUs (NCCL for the DP reduce-scatter)."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    dp = ["--global-batch-size", str(4 * M)] + (["--use-distributed-optimizer"] if distopt else [])

    def run(out: Path, extra: list[str]) -> tuple[list, dict]:
        return train(out, 4, ["--dump-grads", "2", "--", *GPT, *dp, *extra], last_rank=3)

    _, eager = run(tmp_path / "eager", [*DPP, *EAGER])
    results, graphed = run(tmp_path / "graphed", [*ZB, "--dpp-cuda-graphs", "--overlap-grad-reduce"])
    counts = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for r in results for m in REPLAYED.finditer(r.output)}
    assert counts and all(eager_ops == 0 for _, eager_ops in counts.values()), counts
    assert_same_losses(eager, graphed)
    if not distopt:
        assert_same_grads(tmp_path / "eager", tmp_path / "graphed")
@pytest.mark.timeout(700)
@pytest.mark.parametrize("policy", [DPP, ZB], ids=["dpp", "dpp-zb"])
def test_graphed_runtime_param_gather_equals_eager(tmp_path: Path, policy: list[str]) -> None:
    """PP=2 x DP=2, distributed optimizer, --overlap-grad-reduce --overlap-param-gather, every forward
    replayed: a replayed forward runs no module pre-hook, so the runtime starts every parameter
    all-gather after the optimizer step and makes the stream wait for a chunk's before its first forward
    (trainer/pipeline/param_gather.py). Against eager dpp with the distributed optimizer and neither
    overlap (the step gathers synchronously): equal losses -- iterations 2 and 3 would differ on stale
    or half-gathered shards. Needs 4 GPUs (NCCL for the DP collectives)."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    dp = ["--global-batch-size", str(4 * M), "--use-distributed-optimizer"]

    def run(out: Path, extra: list[str]) -> tuple[list, dict]:
        return train(out, 4, ["--", *GPT, *dp, *extra], last_rank=3)

    _, eager = run(tmp_path / "eager", [*DPP, *EAGER])
    results, graphed = run(tmp_path / "graphed", [*policy, "--dpp-cuda-graphs", "--overlap-grad-reduce",
                                                  "--overlap-param-gather"])
    counts = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for r in results for m in REPLAYED.finditer(r.output)}
    assert counts and all(eager_ops == 0 for _, eager_ops in counts.values()), counts
    assert_same_losses(eager, graphed)


def _replayed_everywhere(results: list, chunks: int = 1) -> None:
    counts = {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for r in results for m in REPLAYED.finditer(r.output)}
    print("replayed/eager forwards per (stage, chunk):", counts)
    assert counts == {(s, c): (ITERS * M, 0) for s in range(2) for c in range(chunks)}, counts


@pytest.mark.timeout(400)
def test_use_dpp_alone_replays_graphed_dpp_zb(tmp_path: Path) -> None:
    """The default: --use-dpp alone on CUDA runs dpp-zb from CUDA graphs (every forward replayed), its
    first line says so and why, and it equals eager dpp-zb (--dpp-eager, the opt-out). Its held cap is
    fitted to memory: each stage logs the slots it kept, between its own 1F1B bound and stage 0's, and
    every forward still replays (the policy holds no more than the slots kept)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    results, default = _run(tmp_path / "default", [])
    _replayed_everywhere(results)
    fitted = {int(m[1]): (int(m[2]), int(m[3]), int(m[4])) for r in results for m in FITTED.finditer(r.output)}
    print("held cap fitted (slots, own bound, at most) per stage:", fitted)
    assert sorted(fitted) == [0, 1] and all(own <= kept <= peak for kept, own, peak in fitted.values()), fitted
    assert fitted[0] == (2, 2, 2) and fitted[1][1:] == (1, 2)
    assert any("schedule dpp-zb (--dpp-policy auto: with CUDA graphs" in r.output
               and "graphs: --use-dpp's default where they can run" in r.output for r in results)
    _, eager = _run(tmp_path / "eager", [*ZB, *EAGER])
    assert_same_losses(eager, default)
    assert_same_grads(tmp_path / "eager", tmp_path / "default")


# v1: one count per stage; v2: one per virtual stage (chunk 0 of both stages first), as the benchmark's
# --resplit auto gives its v=2 lines (trainer/schedule/half_split.py balanced_chunk_split).
HALVES = {"v1": (["--pipeline-stage-layers", "2.5,1.5"], "PP=2 VP=1 DP=1 layers 2.5/1.5 |"),
          "v2": (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-stage-layers", "1.5,0.5,1,1"],
                 "PP=2 VP=2 DP=1 layers 1.5/0.5/1/1 |")}


@pytest.mark.timeout(700)
@pytest.mark.parametrize("split", list(HALVES))
@pytest.mark.parametrize("policy", [DPP, ZB], ids=["dpp", "dpp-zb"])
def test_graphed_half_layer_boundary_equals_eager(tmp_path: Path, policy: list[str], split: str) -> None:
    """--pipeline-stage-layers 2.5,1.5: stage 0's graphs end after layer 2's attention, stage 1's begin
    with its MLP (each half a TransformerLayer of its own); every forward replays and the numbers
    equal the eager run's. Under dpp-zb stage 1's deferred weight GEMMs include the split layer's MLP.
    With two chunks per stage (1.5,0.5,1,1) each chunk's graphs hold its own halves."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    flags, logged = HALVES[split]
    _, eager = _run(tmp_path / "eager", [*flags, *policy, *EAGER])
    results, graphed = _run(tmp_path / "graphed", [*flags, *policy, "--dpp-cuda-graphs"])
    _replayed_everywhere(results, chunks=2 if "--num-virtual-stages-per-pipeline-rank" in flags else 1)
    assert any(logged in r.output for r in results), results[0].output[-2000:]
    assert_same_losses(eager, graphed)
    assert_same_grads(tmp_path / "eager", tmp_path / "graphed")


BERT = [*[a for a in GPT if a not in ("--vocab-size", "1000")], "--model", "bert", "--vocab-size", "128",
        "--make-vocab-size-divisible-by", "64"]


@pytest.mark.timeout(700)
@pytest.mark.parametrize("policy", [DPP, ZB], ids=["dpp", "dpp-zb"])
def test_graphed_bert_equals_eager_bert(tmp_path: Path, policy: list[str]) -> None:
    """BERT: the encoder block is graphed; each replay fills its slot's mask buffer with the
    microbatch's padding mask (mock BERT samples are padded to different lengths)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _, eager = _run(tmp_path / "eager", [*policy, *EAGER], BERT)
    results, graphed = _run(tmp_path / "graphed", [*policy, "--dpp-cuda-graphs"], BERT)
    _replayed_everywhere(results)
    assert_same_losses(eager, graphed)
    assert_same_grads(tmp_path / "eager", tmp_path / "graphed")


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.mark.timeout(700)
def test_graphed_dropout_repeats_from_its_seed_and_stays_close_to_eager(tmp_path: Path) -> None:
    """Dropout 0.1 in every graph: the same seed gives the same losses (the masks are a function of
    the seed and the order of forwards, not of timing); another seed other losses; the eager run draws
    other masks from the same distribution, so its losses are close, not equal."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    graphed_flags = [*DPP, "--dpp-cuda-graphs", *DROPOUT]
    results, first = _run(tmp_path / "graphed", graphed_flags)
    _replayed_everywhere(results)
    _, again = _run(tmp_path / "again", graphed_flags)
    assert_same_losses(first, again)
    _, reseeded = _run(tmp_path / "reseeded", [*graphed_flags, "--seed", "4321"])
    assert any(reseeded[it]["lm loss"] != first[it]["lm loss"] for it in first)
    _, eager = _run(tmp_path / "eager", [*DPP, *DROPOUT, *EAGER])
    _, no_dropout = _run(tmp_path / "no-dropout", [*DPP, "--dpp-cuda-graphs"])
    print("iteration  eager  graphed  graphed-without-dropout")
    for it in sorted(first, key=int):
        e, g, n = eager[it]["lm loss"], first[it]["lm loss"], no_dropout[it]["lm loss"]
        print(it, e, g, n)
        assert g == pytest.approx(e, rel=2e-2), f"iteration {it}"
    assert any(first[it]["lm loss"] != no_dropout[it]["lm loss"] for it in first)  # dropout did act
    assert any(first[it]["lm loss"] != eager[it]["lm loss"] for it in first)  # other masks than eager's
