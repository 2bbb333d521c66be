"""Slurm side: recipes, Jinja templates, submit driver (sbatch on the rendered files), node addresses, status.

Never imports torch or megatron (tests/unit/test_import_boundary.py enforces it): it runs on login
nodes that may have neither.
"""
