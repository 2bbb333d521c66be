"""``forward_backward_dpp``: one pipeline step driven by a schedule policy over per-edge links.

Drop-in for megatron-core's ``get_forward_backward_func()`` results: same keyword signature, same
return value (the loss dicts of the last stage, in microbatch order; ``[]`` elsewhere). What a
Megatron schedule hard-codes -- the order of forwards and backwards and the blocking P2P calls -- is
replaced by a loop: ask the policy for a ready action, run it, send its output, and otherwise wait on
*any* arrival. Runtime-only pieces (policy, links, tracer, data by index, TP decision channel) come
from a :class:`DppContext` bound with :func:`make_forward_backward_func` (no globals).

Megatron conventions kept: losses are divided by ``num_microbatches`` (so the order of execution
cannot change the sum), ``config.no_sync_func`` holds gradient reduction until the last backward of
each chunk (with ``--overlap-grad-reduce`` the runtime itself starts each chunk's buckets right after
that backward: trainer.pipeline.grad_sync; with ``--overlap-param-gather`` a chunk's first forward of
the step waits for its parameter all-gathers: trainer.pipeline.param_gather),
``config.finalize_model_grads_func`` runs at the end, ``config.grad_scale_func`` scales
the last stage's loss, and a sent output's storage is freed (``deallocate_pipeline_outputs``) while
its autograd graph is kept for the backward.

Split backward (dpp-zb, zb-h1): ``I(m, c)`` is B's backward with the linears' weight GEMMs recorded
in a store (trainer.pipeline.split_backward) and sends the input gradient upstream exactly like B;
``W(m, c)`` replays that store. Weight gradients are complete only after a chunk's last W, so that
W, not the last I, is "the last backward" of the grad-sync protocol.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.launch.topology import Topology
from trainer.pipeline.grad_sync import GradSync
from trainer.pipeline.param_gather import ParamGather
from trainer.pipeline.run_ahead import RunAheadBound
from trainer.pipeline.split_backward import SplitBackward
from trainer.pipeline.stall import DppStallError, describe_wait
from trainer.pipeline.tp_decision import TpDecisionChannel
from trainer.profiling.tracer import NULL_SPAN, NullTracer, Tracer, now_us
from trainer.schedule.core import Action, Op, PipelineShape, Policy, StageState
from trainer.transport.base import Header, Message, StageLinks, TransportTimeout

log = logging.getLogger(__name__)

MicrobatchData = Callable[[int, int], Any]
"""(microbatch, chunk) -> what ``next(data_iterator)`` returns inside the forward step function."""


@dataclass
class DppContext:
    """Everything the runtime needs besides Megatron's arguments (one per rank, reused every step)."""

    topology: Topology
    policy: Policy
    """Chooses the next action; built for (shape, this stage)."""
    links: StageLinks | None
    """Channels to the neighbour stages; None only with a single pipeline stage."""
    timeout_s: float = 300.0
    """Watchdog: fail when no action can run for this long."""
    microbatch_data: MicrobatchData | None = None
    """Data of microbatch m by index. None: the first M items of each chunk's data iterator are
    read up front and indexed, so execution order can never mis-pair data."""
    tracer: Tracer | NullTracer | None = None
    """trainer.profiling Tracer/NullTracer; None means no tracing (a NullTracer)."""
    tp_channel: TpDecisionChannel | None = None
    """Shared decision log when TP > 1 (leader publishes, followers replay)."""
    iteration: int = 0
    """Set by the trainer before each step; recorded in trace events."""
    microbatch_costs: Callable[[], Sequence[float] | None] | None = None
    """Called once per step: each microbatch's relative cost estimate (e.g. from its sequence length),
    the same on every stage of the pipeline; dynamic policies order microbatches by it
    (StageState.microbatch_costs). None: all alike."""
    gpu_timer: Any = None
    """trainer.profiling.gpu_spans.GpuOpTimer when tracing on CUDA: each op's GPU time becomes a
    "gpu" span of the trace (one synchronize per traced step); None otherwise."""
    split_backward: SplitBackward | None = None
    """From trainer.pipeline.split_backward.install_split_backward on this rank's chunks; required
    when the policy splits backwards into I and W (dpp-zb, zb-h1)."""
    graphs: dict | None = None
    """chunk index -> trainer.pipeline.cuda_graphs.ChunkGraphs (--dpp-cuda-graphs): that chunk's
    forwards and backwards replay CUDA graphs while a slot is free; None = every op eager."""
    run_ahead: RunAheadBound | None = None
    """--dpp-max-queued-ops: how far the host may run ahead of its GPU; None = unbounded."""
    param_gather: ParamGather | None = None
    """--overlap-param-gather (distributed optimizer): the parameter all-gathers started after the
    optimizer step, waited for before each chunk's first forward (trainer.pipeline.param_gather)."""
    peak_inflight: int = field(default=0, init=False)
    """Largest number of held activations seen in the last step (for logs/benchmarks)."""
    landing_checks: int = field(default=0, init=False)
    """dpp-zb (fill_transit, land_forwards): how often this rank asked the transport whether an input
    had landed, and the host time those looks took in all (end-of-run log line)."""
    landing_check_s: float = field(default=0.0, init=False)
    policy_factory: Callable[[int], Policy] | None = None
    """num_microbatches -> this stage's policy for that many microbatches. Policies are built for one
    shape; with --rampup-batch-size the microbatch count changes between steps, and each step then
    runs the policy of its own count (built once per count, kept). None: every step has the count
    ``policy`` was built for."""
    policy_microbatches: int = 0
    """The microbatch count ``policy`` was built for (with policy_factory)."""
    _policies: dict[int, Policy] = field(default_factory=dict, init=False, repr=False)

    def use_microbatches(self, num_microbatches: int) -> None:
        """Make ``policy`` the one for ``num_microbatches`` (see policy_factory)."""
        if self.policy_factory is None or num_microbatches == self.policy_microbatches:
            return
        self._policies[self.policy_microbatches] = self.policy
        if num_microbatches not in self._policies:
            self._policies[num_microbatches] = self.policy_factory(num_microbatches)
        self.policy, self.policy_microbatches = self._policies[num_microbatches], num_microbatches


def make_forward_backward_func(context: DppContext) -> Callable[..., list]:
    """``forward_backward_dpp`` bound to ``context``: call it exactly like Megatron's schedules."""
    return functools.partial(forward_backward_dpp, dpp_context=context)


def forward_backward_dpp(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
    dpp_context: DppContext | None = None,
) -> list:
    """Run one step (all microbatches, forward and backward) under the context's policy.

    ``seq_length``/``micro_batch_size``/``decoder_seq_length``/``adjust_tensor_shapes_fn``/
    ``p2p_communicator`` exist for signature compatibility: headers carry every shape, and the
    context's links replace Megatron's P2P communicator.
    """
    if dpp_context is None:
        raise ValueError("forward_backward_dpp needs a DppContext: use make_forward_backward_func(context)")
    chunks = list(model) if isinstance(model, list) else [model]
    dpp_context.use_microbatches(num_microbatches)
    step = _Step(dpp_context, chunks, forward_step_func, data_iterator, num_microbatches,
                 forward_only, collect_non_loss_data)
    return step.run(pg_collection=pg_collection, force_all_reduce=bool(force_all_reduce))


def _model_config(chunk: torch.nn.Module):
    from megatron.core.utils import get_model_config

    return get_model_config(chunk)


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward through ``output``; uses the C++ engine when its data was freed after sending."""
    if grad is not None and output.numel() != grad.numel():
        # torch.autograd.backward would reject the freed shape; call the C++ engine directly, as
        # megatron's custom_backward does (not imported: its module path moves between releases).
        from torch.autograd import Variable

        Variable._execution_engine.run_backward(
            tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
            allow_unreachable=True, accumulate_grad=True)
    else:
        torch.autograd.backward(output, grad_tensors=grad)


def _free_output(out: torch.Tensor) -> None:
    """Megatron's deallocate_output_tensor: keep grad_fn, drop the activation's storage."""
    if out._base is None:  # a view's storage belongs to another tensor: freeing it gains nothing
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


class _Step:
    """State of one forward_backward call on one rank."""

    def __init__(self, ctx: DppContext, chunks: list, forward_step_func, data_iterator,
                 num_microbatches: int, forward_only: bool, collect_non_loss_data: bool) -> None:
        self.ctx, self.chunks, self.forward_step_func = ctx, chunks, forward_step_func
        self.forward_only, self.collect_non_loss_data = forward_only, collect_non_loss_data
        topo = ctx.topology
        self.stage, self.rank = topo.pp_rank, topo.rank
        self.shape = PipelineShape(topo.pipeline_parallel, num_microbatches, len(chunks))
        if len(chunks) != topo.virtual_pipeline:
            raise ValueError(f"got {len(chunks)} model chunks but the topology has VP={topo.virtual_pipeline}")
        self.config = _model_config(chunks[0])
        costs = ctx.microbatch_costs() if ctx.microbatch_costs is not None else None
        self.state = StageState(self.shape, self.stage, split_backward=ctx.policy.split_backward,
                                microbatch_costs=costs)
        if self.state.split_backward and ctx.split_backward is None and not forward_only:
            raise ValueError(f"policy {ctx.policy.name!r} splits the backward into I and W, but the DppContext "
                             "has no split_backward: install_split_backward(model chunks) first")
        self.data = self._data_source(data_iterator)
        self.tracer = ctx.tracer if ctx.tracer is not None else NullTracer()
        self.acts: dict[tuple[int, int], Message] = {}
        self.grads: dict[tuple[int, int], Message] = {}
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.losses: dict[int, Any] = {}
        # Summed where the loss lives (never copied to the host inside the step: that would sync).
        self.num_tokens: torch.Tensor | None = None
        self.decisions = 0
        # dpp-zb: which arrived gradients (policy fill_transit) and, at v > 1, activations (land_forwards)
        # are still on their way to this device
        self._tracks_landing = bool(getattr(ctx.policy, "tracks_landing", False)) and ctx.links is not None
        self._tracks_act_landing = (bool(getattr(ctx.policy, "tracks_activation_landing", False))
                                    and ctx.links is not None)

    # ---- data ------------------------------------------------------------------------------
    def _data_source(self, data_iterator) -> MicrobatchData:
        if self.ctx.microbatch_data is not None:
            return self.ctx.microbatch_data
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(self.chunks)
        fetched: list[list[Any] | None] = []
        for it in iterators:
            # Megatron iterators are consumed in order by microbatch; read this step's M items
            # up front so the policy's execution order cannot mis-pair tokens and labels.
            fetched.append(None if it is None else [next(it) for _ in range(self.shape.num_microbatches)])
        return lambda m, c: None if fetched[c] is None else fetched[c][m]

    # ---- the loop --------------------------------------------------------------------------
    def run(self, pg_collection, force_all_reduce: bool) -> list:
        ctx = self.ctx
        if ctx.tp_channel is not None:
            ctx.tp_channel.begin_step()
        grad_sync = GradSync(self.config, self.chunks, self.shape.num_microbatches, self.forward_only,
                             force_all_reduce=force_all_reduce)
        if ctx.gpu_timer is not None:
            ctx.gpu_timer.begin_step()
        run_ahead = ctx.run_ahead
        if run_ahead is not None:
            run_ahead.begin_step()
        tracing = self.tracer.enabled
        with grad_sync:
            while not self._finished():
                # Traced: the host time from one op to the next decision is a "decide" span, so the
                # critical path can say what a host did while its GPU idled (profiling.md).
                with self._span("decide", "decide") as span:
                    before = self._host_waits() if tracing else None
                    if run_ahead is not None:
                        run_ahead.before_decide()  # decide near GPU time: see trainer/pipeline/run_ahead.py
                    self._drain()
                    action = self._decide()
                    if before is not None:
                        after = self._host_waits()
                        span.set(run_ahead_ms=round(1e3 * (after[0] - before[0]), 4),
                                 landed_ms=round(1e3 * (after[1] - before[1]), 4))
                if action is None:
                    self._wait_for_arrival()
                    continue
                self._execute(action, grad_sync)
                if run_ahead is not None:
                    run_ahead.after_op(str(action))
        self._check_clean()
        ctx.peak_inflight = self.state.peak_inflight
        if not self.forward_only and self.config.finalize_model_grads_func is not None:
            extra: dict[str, Any] = {}
            if pg_collection is not None:
                extra["pg_collection"] = pg_collection
            if force_all_reduce:
                extra["force_all_reduce"] = True
            tokens = None
            if self.config.calculate_per_token_loss:  # zero on stages that computed no loss
                tokens = self.num_tokens if self.num_tokens is not None else torch.zeros(
                    [], dtype=torch.int, device=_device_of(self.chunks[0]))
            self.config.finalize_model_grads_func(self.chunks, tokens, **extra)
        if ctx.gpu_timer is not None:
            ctx.gpu_timer.end_step(self.tracer)
        return [self.losses[m] for m in sorted(self.losses)]

    def _host_waits(self) -> tuple[float, float]:
        """Host seconds so far waiting for this rank's GPU (run-ahead bound) and asking whether
        gradients landed: a decide span's args are how much each grew inside it."""
        bound = self.ctx.run_ahead
        return (bound.total_waited_s if bound is not None else 0.0), self.ctx.landing_check_s

    def _finished(self) -> bool:
        if self.forward_only:
            return all(Action(Op.F, m, c) in self.state.done
                       for c in range(self.shape.num_chunks) for m in range(self.shape.num_microbatches))
        return self.state.finished

    def _decide(self) -> Action | None:
        """Leader/solo: ask the policy. Follower: replay the leader's next decision."""
        channel, state = self.ctx.tp_channel, self.state
        if channel is None or channel.is_leader:
            action = self._choose()
            if action is not None and channel is not None:
                channel.publish(self.decisions, action)
        else:
            action = channel.read(self.decisions, self.ctx.timeout_s)
            while not state.is_ready(action):  # leader saw its inputs; ours are on the way
                self._record(self._wait_any(f"inputs of {action} (decided by TP rank 0)"))
        if action is not None:
            self.decisions += 1
        return action

    def _choose(self) -> Action | None:
        if not self.forward_only:
            state = self.state
            if state.grads_in_transit or state.acts_in_transit:  # look again at the inputs still on their way
                ctx, start = self.ctx, time.perf_counter()
                for key in [k for k in state.grads_in_transit if ctx.links.landed(self.grads[k])]:
                    state.mark_grad_landed(*key)
                for key in [k for k in state.acts_in_transit if ctx.links.landed(self.acts[k])]:
                    state.mark_activation_landed(*key)
                ctx.landing_checks += 1
                ctx.landing_check_s += time.perf_counter() - start
            return self.ctx.policy.choose(self.state)
        # Inference: forwards only, oldest first; the policy's backward-aware caps do not apply.
        ready = [a for a in self.state.ready_actions() if a.op is Op.F]
        return min(ready, key=lambda a: (a.chunk, a.microbatch)) if ready else None

    def _drain(self) -> None:
        links = self.ctx.links
        while links is not None and (msg := links.poll()) is not None:
            self._record(msg)

    def _wait_for_arrival(self) -> None:
        self._record(self._wait_any("any input the policy would run"))

    def _wait_any(self, what: str) -> Message:
        links = self.ctx.links
        if links is None:
            raise DppStallError(describe_wait(self.state, self.rank, self.ctx.timeout_s, what))
        try:
            with self._span("wait", "wait", tid="wait"):
                return links.wait_any(self.ctx.timeout_s)
        except TransportTimeout as exc:
            raise DppStallError(describe_wait(self.state, self.rank, self.ctx.timeout_s, what)) from exc

    def _record(self, msg: Message) -> None:
        h = msg.header
        key = (h.microbatch, h.chunk)
        if self.tracer.enabled:
            now = now_us()
            self.tracer.record(f"recv {h.kind} m{h.microbatch}.c{h.chunk}", "recv", now, now, tid="comm",
                               microbatch=h.microbatch, chunk=h.chunk, stage=self.stage,
                               inflight=self.state.inflight)
        if h.kind == "act":
            assert key not in self.acts, f"rank {self.rank}: activation {key} arrived twice"
            self.acts[key] = msg
            self.state.mark_activation_arrived(*key, landed=not self._tracks_act_landing)
        else:
            assert key not in self.grads, f"rank {self.rank}: gradient {key} arrived twice"
            self.grads[key] = msg
            # Tracked: counted in transit until a decision looks (one look per decision serves them all).
            self.state.mark_grad_arrived(*key, landed=not self._tracks_landing)

    # ---- actions ---------------------------------------------------------------------------
    def _execute(self, action: Action, grad_sync: GradSync) -> None:
        timer = self.ctx.gpu_timer
        if timer is not None:
            self._queue_input_wait(action)
        gpu = (timer.around(str(action), microbatch=action.microbatch, chunk=action.chunk, op=action.op.value)
               if timer is not None else NULL_SPAN)
        with self._span(str(action), action.op.value, microbatch=action.microbatch,
                        chunk=action.chunk) as span, gpu:
            if action.op is Op.F:
                output = self._forward(action.microbatch, action.chunk)
            elif action.op is Op.W:
                output = self._weight_step(action.microbatch, action.chunk, grad_sync)
            else:  # B, or I: the same backward with the weight GEMMs deferred to W
                output = self._backward_step(action.microbatch, action.chunk, grad_sync)
            self.state.mark_done(action)
            if self.forward_only and action.op is Op.F:
                self.state.inflight -= 1  # nothing is held for a backward in inference
            span.set(inflight=self.state.inflight)
        if output is not None:
            self._send(action, output)

    def _queue_input_wait(self, action: Action) -> None:
        """Read the op's input message once, before its GPU span opens (tracing on CUDA only). The
        first read of ``Message.tensor`` queues the stream's wait for a payload still in flight; inside
        the span that wait counted as the op's GPU time, so a stage waiting for its neighbour looked
        busy (4xH100 traces: ops on the critical path summed to ~11% more than the step).
        The op reads this input before queuing any kernel, so moving the read changes no order."""
        key = (action.microbatch, action.chunk)
        msg = self.acts.get(key) if action.op is Op.F else self.grads.get(key) if action.op in (Op.B, Op.I) else None
        if msg is not None:
            msg.tensor  # noqa: B018 - read for its side effect (the queued wait)

    def _forward(self, m: int, c: int) -> torch.Tensor | None:
        shape, chunk = self.shape, self.chunks[c]
        first = shape.is_first_virtual(self.stage, c)
        last = shape.is_last_virtual(self.stage, c)
        if self.ctx.param_gather is not None:
            # Before anything of the forward is queued, eager or replayed: the chunk's parameters
            # all-gathered after the last optimizer step (a no-op after its first forward).
            self.ctx.param_gather.before_forward(c)
        input_tensor = None
        if not first:
            msg = self.acts.pop((m, c))
            # Copy out of the receive slot: the activation must outlive the slot until backward.
            input_tensor = msg.tensor.detach().clone().requires_grad_(not self.forward_only)
            self.ctx.links.release(msg)
        from megatron.core.utils import get_attr_wrapped_model

        get_attr_wrapped_model(chunk, "set_input_tensor")([input_tensor])
        data = self.data(m, c)
        model = self._graph_replay(m, c, first, input_tensor, data) or chunk
        autocast = (torch.autocast(_device_type(chunk), dtype=self.config.autocast_dtype)
                    if getattr(self.config, "enable_autocast", False) else contextlib.nullcontext())
        with autocast:
            output, loss_func = self.forward_step_func(iter([data]), model)
        if last:
            output = self._loss(m, output, loss_func)
        if not self.forward_only:
            self.saved[(m, c)] = (input_tensor, output)
        return None if last else output

    def _graph_replay(self, m: int, c: int, first: bool, input_tensor: torch.Tensor | None, data: Any):
        """A CUDA-graph stand-in for chunk ``c`` in this forward (--dpp-cuda-graphs), or None: no
        graphs for the chunk, inference, no free slot, or a shape that was not captured."""
        graphs = self._graphs_of(c)
        if graphs is None or self.forward_only or not isinstance(data, dict):
            return None
        from trainer.pipeline.cuda_graphs import Replay

        tokens = data["tokens"] if "tokens" in data else data["text"]  # GPT's batch, BERT's
        call = graphs.take(m, tokens if first else input_tensor)
        return None if call is None else Replay(graphs, call, self.chunks[c])

    def _graphs_of(self, c: int):
        """Chunk ``c``'s CUDA graph slots (--dpp-cuda-graphs), or None."""
        return self.ctx.graphs.get(c) if self.ctx.graphs else None

    def _loss(self, m: int, output: torch.Tensor, loss_func) -> torch.Tensor:
        """Megatron's forward_step_calc_loss: scale by 1/M (and by tokens for 3-tuples), keep the dict."""
        if loss_func is None:
            self.losses[m] = output
            return output
        if self.collect_non_loss_data:
            self.losses[m] = loss_func(output, non_loss_data=True)
            return output
        outputs = loss_func(output)
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            if not self.config.calculate_per_token_loss:
                loss = loss / torch.clamp(num_tokens, min=1)
                loss = loss / self.shape.num_microbatches
            counted = num_tokens.detach().to(torch.int)
            self.num_tokens = counted if self.num_tokens is None else self.num_tokens + counted
        else:
            loss, reduced = outputs
            loss = loss / self.shape.num_microbatches
        self.losses[m] = reduced
        return loss

    def _backward_step(self, m: int, c: int, grad_sync: GradSync) -> torch.Tensor | None:
        input_tensor, output = self.saved.pop((m, c))
        graphs = self._graphs_of(c)
        graphed = graphs is not None and graphs.holds(m)
        msg = None
        if self.shape.is_last_virtual(self.stage, c):
            grad = None
            if self.config.grad_scale_func is not None:
                output = self.config.grad_scale_func(output)
        else:
            msg = self.grads.pop((m, c))
            grad = msg.tensor  # read-only use during backward: no copy out of the slot
            if self.state.split_backward and not graphed:
                # ...except for an eager I: the weight-gradient store can keep this very tensor
                # (autograd passes it unchanged through adds and p=0 dropout to the chunk's last
                # linear) until W, and the slot is reused by the next arrival as soon as it is
                # released. (A replayed I copies it into its graph's input first, and what its W
                # reads from the backward pool into buffers of its own: trainer/pipeline/graph_operands.py.)
                grad = grad.clone()
                self.ctx.links.release(msg)
                msg = None
        if input_tensor is not None:
            input_tensor.retain_grad()
        if self.state.split_backward:
            # I: grad sync waits for the chunk's last W, which completes its weight gradients.
            with self.ctx.split_backward.capture((m, c)):
                _backward(output, grad)
        else:
            grad_sync.before_backward(c)
            _backward(output, grad)
            grad_sync.after_backward(c)
        if msg is not None:
            self.ctx.links.release(msg)
        if graphed and not self.state.split_backward:
            # The replay is queued: a later forward may take the slot (it runs after, on this stream).
            # (After an I the slot stays taken: its W graph still reads the activations in it.)
            graphs.give_back(m)
        if self.shape.is_first_virtual(self.stage, c):
            return None
        # A replayed backward leaves the input gradient in the slot's static buffer, which the slot's
        # next backward overwrites -- possibly before the transport's side-stream copy upstream has
        # read it (nothing orders the two): send a copy made on this stream instead.
        return input_tensor.grad.clone() if graphed else input_tensor.grad

    def _weight_step(self, m: int, c: int, grad_sync: GradSync) -> None:
        """W: the weight GEMMs I deferred; frees the inputs and output grads the store held."""
        grad_sync.before_backward(c)
        self.ctx.split_backward.replay((m, c))  # eager GEMMs: an eager I's, or the last stage's head
        graphs = self._graphs_of(c)
        if graphs is not None:
            graphs.replay_weights(m)  # a replayed I's GEMMs, then the slot is free for a forward
        grad_sync.after_backward(c)

    def _send(self, action: Action, tensor: torch.Tensor) -> None:
        m, c = action.microbatch, action.chunk
        if action.op is Op.F:
            direction, kind, peer = "next", "act", self.shape.downstream(self.stage, c)
        else:
            direction, kind, peer = "prev", "grad", self.shape.upstream(self.stage, c)
        assert peer is not None, f"{action} has no {direction} stage"
        payload = tensor.detach()
        header = Header(kind=kind, microbatch=m, chunk=peer[1], dtype=str(payload.dtype).removeprefix("torch."),
                        shape=tuple(payload.shape))
        with self._span(f"send {kind} m{m}.c{peer[1]}", "send", tid="comm", microbatch=m, chunk=c):
            self.ctx.links.send(direction, payload, header)
        if action.op is Op.F and self.config.deallocate_pipeline_outputs and not self.forward_only:
            # The link holds its own reference to the storage for as long as it needs it.
            _free_output(tensor)

    # ---- helpers ---------------------------------------------------------------------------
    def _span(self, name: str, cat: str, tid: str = "compute", microbatch: int = -1, chunk: int = -1):
        if not self.tracer.enabled:
            return NULL_SPAN
        return self.tracer.span(name, cat, tid=tid, iteration=self.ctx.iteration, microbatch=microbatch,
                                chunk=chunk, stage=self.stage, inflight=self.state.inflight)

    def _check_clean(self) -> None:
        leftovers = [f"{k}" for k in self.acts] + [f"grad {k}" for k in self.grads]
        assert not leftovers, f"rank {self.rank}: step ended with unconsumed messages {leftovers}"
        assert not self.saved or self.forward_only, f"rank {self.rank}: activations still held {list(self.saved)}"
        pending = self.ctx.split_backward.pending() if self.ctx.split_backward is not None else []
        assert not pending, f"rank {self.rank}: step ended with weight gradients never replayed {pending}"
        taken = {c: g.in_use() for c, g in (self.ctx.graphs or {}).items() if g.in_use()}
        assert not taken, f"rank {self.rank}: step ended with CUDA graph slots still taken {taken}"


def _device_of(chunk: torch.nn.Module) -> torch.device:
    try:
        return next(chunk.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _device_type(chunk: torch.nn.Module) -> str:
    try:
        return next(chunk.parameters()).device.type
    except StopIteration:
        return "cpu"
