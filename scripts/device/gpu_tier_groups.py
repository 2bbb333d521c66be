"""The GPU tests (``pytest -m gpu``) as the 4-GPU tier calls run them: each group is one pytest run,
on a GPU pair (two ranks on cuda:0/1 of what it sees) or on all four. Part 1 and part 2 are one
device call each (scripts/device/call_4gpu_tier.sh PART), each under the 10-minute limit.

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
    "A": [f"{_G}/test_transport_gpu.py", f"{_GRAPHS}[v1]", f"{_GRAPHS}[v2]", f"{_GRAPHS}[v1-varlen]",
          f"{_G}/test_megatron_cuda_graphs.py"],
    "B": [f"{_G}/test_transport_nccl_gpu.py", f"{_GRAPHS}[v1-recompute]", f"{_GRAPHS}[v1-queued1]",
          f"{_GRAPHS}[v1-recompute-slot]", f"{_G}/test_checkpoint_gpu.py", f"{_G}/test_gpu_spans.py"],
    "C": [f"{_G}/test_dpp_nccl_split.py"],
    # part 2: the split-backward graphs (tenth session), side by side, then the 2-rank loss test and the NCCL clock sync
    "Z1": [f"{_GRAPHS}[zb-v1]", f"{_GRAPHS}[zb-v2]"],
    "Z2": [f"{_GRAPHS}[zb-v1-varlen]", f"{_GRAPHS}[zb-v1-recompute-slot]"],
    "E": [f"{_TRAIN}::test_dpp_on_cuda_ipc_equals_1f1b_with_two_ranks_sharing_one_gpu",
          "tests/dist/test_clock_offset.py::test_offsets_undo_injected_skew_over_nccl"],
    # part 4: the static orders (1F1B, interleaved, ZB-H1) from CUDA graphs against their eager runs (2 ranks)
    "S": [f"{_G}/test_static_graphs.py"],
    # part 3: first 10 losses of every DPP policy against megatron-core's 1F1B, issue-12 model, 4 GPUs
    "D": [f"{_TRAIN}::test_dpp_first_ten_losses_match_megatron_1f1b_on_4_gpus"],
}
PARTS: dict[str, tuple[tuple[str, ...], str, int, int]] = {
    "1": (("A", "B"), "C", 400, 140),
    "2": (("Z1", "Z2"), "E", 300, 200),
    "3": ((), "D", 0, 560),
    "4": ((), "S", 0, 560),
}
"""Part -> (groups run side by side on GPU pairs 0,1 and 2,3; the group run on all four GPUs after
them; seconds for the pairs; seconds for the last group)."""

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in GROUPS:
        sys.exit(f"usage: {sys.argv[0]} GROUP  (one of {', '.join(GROUPS)})")
    print("\n".join(GROUPS[sys.argv[1]]))
