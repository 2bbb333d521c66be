"""``python -m tests.unit.print_affinity``: prints the CPUs this process may run on (launcher test)."""

import os

print(f"affinity {sorted(os.sched_getaffinity(0))}")
