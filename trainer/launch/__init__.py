"""Starting a run's processes: local ranks and their CPU binding (local_ranks.py, cpu_binding.py), the
process group and its topology (distributed.py, topology.py, node_addresses.py, ports.py), the run's
token for shared names (run_token.py), the signal handling its children inherit (early_signals.py)
and stopping a child's whole process group (group_stop.py)."""
