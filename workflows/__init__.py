"""Slurm side: recipes, Jinja templates, submitit driver, node addresses, status.

Never imports torch or megatron (tests/unit/test_import_boundary.py enforces it): it runs on login
nodes that may have neither.
"""
