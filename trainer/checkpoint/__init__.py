"""Checkpoints: what a checkpoint holds and how it is saved and loaded (state.py), and the watchdog that
bounds every save and load with a timeout (watchdog.py)."""
