"""Everything that runs inside a training job: train loop, models, data, schedule, transport, profiling.

Never imports submitit or jinja2 (tests/unit/test_import_boundary.py enforces it).
"""
