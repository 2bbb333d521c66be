"""Side-by-side pipeline benchmark (``python -m trainer.bench.pipeline``). Nothing else in trainer imports
this package: it sits on top of the trainer, which keeps the import graph a tree."""
