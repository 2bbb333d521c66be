"""Checkpoints: finding the one to resume (find.py), what a checkpoint holds and how it is saved and
loaded (state.py; facts.py: what they need to know of the run), what of a Megatron-LM checkpoint is loaded besides its weights (megatron_lm.py), and
the watchdog that bounds every save and load with a timeout (watchdog.py)."""
