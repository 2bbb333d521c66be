"""Meeting Megatron-LM and megatron-core: version shims (compat.py) and Megatron-LM's command-line flag
names and meanings (flags.py), and importing megatron-core without TorchDynamo where its fusions are never
called (jit.py)."""
