"""Per-rank Chrome trace events and the aggregation of all ranks into one timeline."""
