"""What the submitit driver prints of the aggregation's summary.json (workflows.submitit_chain.format_summary)."""

from __future__ import annotations

from trainer.schedule.stage_balance import stage_balance
from workflows.submitit_chain import format_summary

SUMMARY = {"schedule": "dpp", "pipeline_parallel": 4, "num_microbatches": 8, "iterations": [1, 2],
           "mean_iteration_time_ms": 10.0, "bubble_fraction": 0.2, "theoretical_1f1b_bubble": 0.27,
           "stages": [{"stage": s, "busy_ms": 8.0, "idle_ms": 2.0, "bubble_fraction": 0.2, "peak_inflight": 4 - s}
                      for s in range(4)]}


def test_the_driver_names_a_persistently_slow_stage_and_the_re_split() -> None:
    heavy_head = stage_balance([[4.2, 4.0, 4.0, 6.0], [4.2, 4.0, 4.1, 6.1]], [4, 4, 4, 4]).to_dict()
    text = format_summary(dict(SUMMARY, stage_balance=heavy_head))
    assert ("  stage balance: stage 3 persistently slowest (+48%); re-split 4/5/5/2: "
            "--decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 2 "
            "(slowest stage -16% predicted)") in text, text
    even = stage_balance([[4.0, 4.0, 4.0, 4.0]], [4, 4, 4, 4]).to_dict()
    assert "  stage balance: no stage persistently slowest" in format_summary(dict(SUMMARY, stage_balance=even))
    # Traces that do not record the layer split (older runs): no balance line, the rest as before.
    text = format_summary(dict(SUMMARY, stage_balance=None))
    assert "stage balance" not in text and "  stage 3: busy 8.00 ms" in text
