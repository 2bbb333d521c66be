"""megatron-core DistributedDataParallel whose overlapped reduction the pipeline runtime launches.

With ``overlap_grad_reduce`` megatron DDP's gradient hook does two things per parameter: add
``param.grad`` into the contiguous ``main_grad`` buffer, and count the parameter ready for its
bucket group, which starts the group's asynchronous reduction once every parameter was counted in
the step's last microbatch. Under the DPP runtime the second half is wrong twice over: with a split
backward the hooks of the linears' weights fire during I with no gradient (megatron's hook asserts
on it; W adds those gradients into ``main_grad`` later), and a backward replayed from a CUDA graph
runs no hook. So here the hook keeps only the first half, and the runtime starts each bucket
group itself once the op that completes its gradients has run (trainer/pipeline/grad_sync.py).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def runtime_reduced_ddp() -> type:
    """The DistributedDataParallel subclass (built on first use: megatron is imported lazily)."""
    from megatron.core.distributed import DistributedDataParallel

    class RuntimeReducedDDP(DistributedDataParallel):
        """megatron DDP whose hooks accumulate gradients but never start a reduction."""

        reduction_launched_by_runtime = True
        """Read by trainer.pipeline.grad_sync.ChunkReduction.supported."""

        def _make_backward_post_hook(self, param: torch.nn.Parameter):
            accumulate = super()._make_backward_post_hook(param)
            group = self.param_to_bucket_group.get(param)

            def hook(*unused):
                if param.grad is None:
                    return  # a weight whose gradient a split backward's W adds to main_grad itself
                if group is None:
                    return accumulate(*unused)
                # megatron's hook counts the parameter ready only in the "last microbatch"; hiding
                # that flag keeps the counting (and so any hook-started reduction) off.
                last, group.is_last_microbatch = group.is_last_microbatch, False
                try:
                    accumulate(*unused)
                finally:
                    group.is_last_microbatch = last

            return hook

    return RuntimeReducedDDP
