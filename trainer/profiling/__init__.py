"""Per-rank Chrome trace events and the aggregation of all ranks into one timeline (docs/profiling.md).

Runtime side: :func:`make_tracer` (tracer.py) and :func:`measure_clock_offset` (clock.py).
Megatron-LM's ``--manual-gc`` lives here too (manual_gc.py): its collections are timed into the trace.
Offline side: ``python -m trainer.profiling.aggregate`` (loading -> merge -> validate -> summary -> plot).
Importing this package imports neither torch nor matplotlib: both load only where they are used.
"""

from trainer.profiling.clock import measure_clock_offset
from trainer.profiling.tracer import NullTracer, Tracer, make_tracer
from trainer.profiling.validate import validate_trace

__all__ = ["NullTracer", "Tracer", "make_tracer", "measure_clock_offset", "validate_trace"]
