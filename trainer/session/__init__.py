"""One rank's training run, by concern: building it (build.py), its microbatches (microbatches.py) and
its log lines (logs.py); the loop itself is trainer/train.py's TrainingSession."""
