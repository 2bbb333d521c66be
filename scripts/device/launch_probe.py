"""How fast this host queues CUDA kernels: microseconds per launch of a tiny kernel (one rank, one GPU),
the figure that decides whether megatron-core's eager stage 0 is launch-bound (slow host) or not."""

import time

import torch

x = torch.zeros(16, device="cuda")
for _ in range(2000):
    x.add_(1)
torch.cuda.synchronize()
n = 20000
start = time.perf_counter()
for _ in range(n):
    x.add_(1)
host = time.perf_counter() - start
torch.cuda.synchronize()
print(f"[host] {torch.cuda.get_device_name()}: {host / n * 1e6:.2f} us per eager kernel launch (host side, {n} launches)")
