"""What a run reports about itself: metrics_rank*.json, which the benchmark reads (run_metrics.py), and
the model FLOPs per iteration behind the TFLOP/s of the log line (flops.py)."""
