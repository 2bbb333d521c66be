"""The GPU tests (``pytest -m gpu``) as the 4-GPU tier calls run them: each group is one pytest run,
on a GPU pair (two ranks on cuda:0/1 of what it sees) or on all four. Each part is one
device call (scripts/device/call_4gpu_tier.sh PART), each under the 10-minute limit.

    python scripts/device/gpu_tier_groups.py NAME   # the test ids of group NAME, one per line

tests/unit/test_gpu_tier_groups.py holds the groups to the collected GPU tests: a GPU test that no
group runs fails the CPU tier instead of silently never running."""

from __future__ import annotations

import sys

_G = "tests/gpu"
_GRAPHS = f"{_G}/test_dpp_cuda_graphs.py::test_graphed_dpp_equals_eager_dpp"
_TRAIN = "tests/dist/test_train_gpu.py"

GROUPS: dict[str, list[str]] = {
    # part 1: A and B side by side on GPUs 0,1 and 2,3, then C on all four
    "A": [f"{_G}/test_transport_gpu.py", f"{_GRAPHS}[v1]", f"{_GRAPHS}[v2]", f"{_GRAPHS}[v1-varlen]"],
    "B": [f"{_G}/test_transport_nccl_gpu.py", f"{_GRAPHS}[v1-recompute]", f"{_GRAPHS}[v1-queued1]",
          f"{_GRAPHS}[v1-recompute-slot]", f"{_G}/test_checkpoint_gpu.py", f"{_G}/test_gpu_spans.py",
          f"{_G}/test_memory_history_gpu.py"],
    "C": [f"{_G}/test_dpp_nccl_split.py"],
    # part 2: the split-backward graphs, side by side, then the 2-rank loss test and the NCCL clock sync
    "Z1": [f"{_GRAPHS}[zb-v1]", f"{_GRAPHS}[zb-v2]", f"{_GRAPHS}[zb-v2-one-set]",
           f"{_G}/test_dpp_cuda_graphs.py::test_use_dpp_alone_replays_graphed_dpp_zb"],
    "Z2": [f"{_GRAPHS}[zb-v1-varlen]", f"{_GRAPHS}[zb-v1-recompute-slot]",
           f"{_G}/test_dpp_cuda_graphs.py::test_graphed_half_layer_boundary_equals_eager",
           f"{_G}/test_layer_halves_gpu.py"],
    "E": [f"{_TRAIN}::test_dpp_on_cuda_ipc_equals_1f1b_with_two_ranks_sharing_one_gpu",
          "tests/dist/test_clock_offset.py::test_offsets_undo_injected_skew_over_nccl"],
    # part 6: the static orders (1F1B, interleaved, ZB-H1) from CUDA graphs against their eager runs (2 ranks);
    # a Llama model under DPP against megatron-core's 1F1B (2 GPUs)
    "S": [f"{_G}/test_static_graphs.py", f"{_G}/test_llama_gpu.py"],
    # part 3: first 10 losses of every DPP policy against megatron-core's 1F1B, the benchmark model gpt16-h2048, 4 GPUs
    "D": [f"{_TRAIN}::test_dpp_first_ten_losses_match_megatron_1f1b_on_4_gpus"],
    # part 5: graphed dpp-zb with the runtime-launched overlapped DP reduction, PP=2 x DP=2 on 4 GPUs;
    # then --rampup-batch-size under megatron-core's 1F1B, eager and graphed dpp-zb (2 GPUs; PP=4 from 2 microbatches on 4)
    "L": [f"{_G}/test_dpp_cuda_graphs.py::test_graphed_dpp_zb_with_overlapped_dp_reduction_equals_eager",
          f"{_G}/test_rampup_gpu.py"],
    # part 4: graphs with dropout, BERT, TP (pairs: TP=2 on one stage), megatron-core's graphs at PP=1 and 2;
    # then PP=2 x TP=2 (sequence parallelism; dpp-zb) on all four
    "G1": [f"{_G}/test_graph_rng.py", f"{_G}/test_dpp_cuda_graphs.py::test_graphed_dropout_repeats_from_its_seed_"
           "and_stays_close_to_eager", f"{_G}/test_megatron_cuda_graphs.py"],
    "G2": [f"{_G}/test_tp_cuda_graphs.py::test_tp2_slot_graphs_equal_eager",
           f"{_G}/test_dpp_cuda_graphs.py::test_graphed_bert_equals_eager_bert"],
    "T4": [f"{_G}/test_tp_cuda_graphs.py::test_pp2_tp2_graphs_equal_eager"],
    # part 7: graphed dpp and dpp-zb with the runtime's parameter all-gathers (--overlap-param-gather),
    # PP=2 x DP=2 on 4 GPUs
    "P": [f"{_G}/test_dpp_cuda_graphs.py::test_graphed_runtime_param_gather_equals_eager"],
    # part 8: Transformer Engine's layers under 1F1B, eager DPP and graphed DPP (2 GPUs; skips without TE:
    # carry .te/whl and .te/wheel, which call_4gpu_tier.sh installs for this part)
    "TE": [f"{_G}/test_te_gpu.py"],
    # part 9: split backward with Transformer Engine's linears (eager dpp-zb) against megatron-core's 1F1B and
    # the unsplit run's gradients (2 GPUs; carry .te/whl and .te/wheel as for part 8)
    "TS": [f"{_G}/test_te_split_gpu.py"],
    # part 10: --use-dpp alone against megatron-core's 1F1B losses on the layouts benchmark's other layouts
    # (PP=2 x TP=2 + SP, PP=2 x DP=2 + overlap + distributed optimizer, BERT PP=4), 4 GPUs
    "LY": [f"{_G}/test_layouts_gpu.py"],
}
PARTS: dict[str, tuple[tuple[str, ...], str, int, int]] = {
    "1": (("A", "B"), "C", 400, 140),
    "2": (("Z1", "Z2"), "E", 300, 200),
    "3": ((), "D", 0, 560),
    "4": (("G1", "G2"), "T4", 340, 230),
    "5": ((), "L", 0, 500),
    "6": ((), "S", 0, 560),
    "7": ((), "P", 0, 500),
    "8": ((), "TE", 0, 300),
    "9": ((), "TS", 0, 540),
    "10": ((), "LY", 0, 560),
}
"""Part -> (groups run side by side on GPU pairs 0,1 and 2,3; the group run on all four GPUs after
them; seconds for the pairs; seconds for the last group)."""

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in GROUPS:
        sys.exit(f"usage: {sys.argv[0]} GROUP  (one of {', '.join(GROUPS)})")
    print("\n".join(GROUPS[sys.argv[1]]))
