"""``--overlap-param-gather`` under the pipeline runtime: the runtime starts and waits for megatron's
parameter all-gathers, not megatron DDP's forward pre-hooks.

With the distributed optimizer each data-parallel rank updates only its shard of the parameters; the
other ranks' shards reach it by an all-gather of every DDP bucket group (megatron-core's
``_ParamAndGradBucketGroup.start_param_sync`` / ``finish_param_sync``). With ``overlap_param_gather``
megatron leaves that all-gather to forward pre-hooks on every module: the first forward to use a bucket
dispatches it and waits, then dispatches the next bucket's. Under this runtime that is wrong twice over:

* a forward replayed from a CUDA graph runs no module pre-hook, so a graphed chunk would never wait
  (nor, if no forward of the step ran eagerly, ever start): it would compute on stale shards;
* the hooks issue each chunk's first all-gather when the chunk's first forward runs, and with
  virtual pipeline stages the DPP policies order the chunks' first forwards on each replica's own
  arrivals -- DP replicas could issue their collectives in different orders.

So the runtime drives them (megatron's hooks are removed when it takes over): right after the optimizer
step, :meth:`ParamGather.start` starts every bucket group's asynchronous all-gather in one fixed order
(chunk 0 .. v-1; within a chunk megatron's all-gather order, the reverse of its bucket-group list, i.e.
first layers first), the same point and order on every DP replica; before a chunk's first forward of
the next step -- training or evaluation, eager or replayed -- :meth:`ParamGather.before_forward` waits
for that chunk's groups (``finish_param_sync``: on CUDA the compute stream waits for the all-gather,
the host does not). The gathers overlap whatever runs between the step and that forward: the loss
report, the data, and on every stage but the first the upstream stages' first forwards; on stage 0
with v > 1, chunk 0's forwards hide chunk 1's gather. Granularity is a chunk: megatron's hooks wait
bucket by bucket inside the forward.

A checkpoint save finishes every gather first (trainer.checkpoint.state.sync_overlapped_params,
megatron's ``start_param_sync(force_sync=True)``, as Megatron-LM's ``disable_forward_pre_hook`` before a
save); the training session finishes them after the last step (Megatron-LM does the same at the end of
``train()``), so the model it leaves holds the updated parameters everywhere. The first step has none
to wait for: every DP replica starts from the same weights (built from one seed, or loaded).
"""

from __future__ import annotations

from typing import Any


class ParamGather:
    """The runtime's parameter all-gathers of one rank's model chunks (module docstring)."""

    def __init__(self, chunks: list, rank: int) -> None:
        self.rank = rank
        self.groups = [list(c.bucket_groups) + list(getattr(c, "expert_parallel_bucket_groups", [])) for c in chunks]
        self.pending = [False] * len(chunks)
        """Per chunk: its all-gathers were started after the last optimizer step, not yet waited for."""
        self.started = self.waited = 0
        """Chunks started / waited for so far (logs and tests)."""
        for chunk in chunks:
            if getattr(chunk, "remove_forward_pre_hook_handles", None):
                # megatron's hooks would wait a second time in eager forwards, and dispatch gathers
                # in the order the forwards happen to run (module docstring).
                chunk.disable_forward_pre_hook(param_sync=False)

    @staticmethod
    def supported(chunk: Any) -> bool:
        """Whether ``chunk`` is a megatron DDP chunk whose parameters are all-gathered after the step
        (the distributed optimizer with ``overlap_param_gather``)."""
        ddp_config = getattr(chunk, "ddp_config", None)
        return bool(getattr(ddp_config, "use_distributed_optimizer", False)
                    and getattr(ddp_config, "overlap_param_gather", False))

    def start(self) -> None:
        """COLLECTIVE over each DP group, right after the optimizer step: start every chunk's all-gathers."""
        for c, groups in enumerate(self.groups):
            for group in reversed(groups):  # megatron's all-gather order (next_param_gather_bucket_group)
                if group.param_gather_handle is not None:
                    # Never waited for (no forward of the chunk since the last start): megatron starts a
                    # group's gather only with none in flight, and force_sync waits for that one (a
                    # local wait; finish_param_sync would dispatch again after finalize_model_grads).
                    group.start_param_sync(force_sync=True)
                group.start_param_sync()
            self.pending[c] = True
            self.started += 1

    def before_forward(self, chunk: int) -> None:
        """Before chunk ``chunk``'s first forward after a step: wait for its all-gathers (a no-op once done)."""
        if not self.pending[chunk]:
            return
        groups = self.groups[chunk]
        for i, group in enumerate(reversed(groups)):
            try:
                # Waits (and, were it not dispatched, dispatches) this group's gather only: every group
                # was started by start(), so megatron's chaining to the next group stays off.
                group.finish_param_sync(skip_next_bucket_dispatch=True)
            except Exception as exc:
                raise RuntimeError(f"rank {self.rank}: waiting for chunk {chunk}'s parameter all-gather "
                                   f"(bucket group {i + 1} of {len(groups)}, over its data-parallel group; "
                                   f"--overlap-param-gather) failed: {exc}") from exc
        self.pending[chunk] = False
        self.waited += 1

    def finish_all(self) -> None:
        """Wait for every chunk's all-gathers still pending (after the last step)."""
        for c in range(len(self.groups)):
            self.before_forward(c)
