"""The DPP runtime replays a static order exactly: 1F1B, interleaved 1F1B and ZB-H1 under --use-dpp.

Every stage of a pipeline runs ``forward_backward_dpp`` in a thread of this process, over in-memory
links that deliver each message after a random delay (so arrivals come out of order and an action
other than the order's next one is often ready first). A runtime that ran "whatever is ready" would
reorder; the one under test must wait for the next listed action's input. What ran is read from the
runtime's own trace spans (the tracer sees ``_execute``, not the policy), and the gradients must
equal a plain autograd reference. The links are a stand-in for the transports (no second process
here); tests/dist/test_dpp_equivalence.py runs the same policies over the real ones.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from trainer.launch.topology import Topology
from trainer.pipeline import DppContext, forward_backward_dpp
from trainer.pipeline.runtime import graph_slots
from trainer.pipeline.split_backward import SplitBackward
from trainer.schedule.core import Op, PipelineShape
from trainer.schedule.dynamic import one_f_one_b_cap
from trainer.schedule.registry import make_policy
from trainer.schedule.static import peak_held_per_chunk
from trainer.transport.base import Message, StageLinks, TransportTimeout


def _config() -> SimpleNamespace:
    return SimpleNamespace(no_sync_func=None, grad_sync_func=None, finalize_model_grads_func=None,
                           grad_scale_func=None, calculate_per_token_loss=False, deallocate_pipeline_outputs=False,
                           enable_autocast=False)


class ScaleChunk(torch.nn.Module):
    """y = w * x; a later virtual stage reads x from set_input_tensor, as megatron's chunks do."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.config = _config()
        self.w = torch.nn.Parameter(torch.tensor(weight))
        self.input = None

    def set_input_tensor(self, tensors) -> None:
        self.input = tensors[0]

    def forward(self, x):
        return self.w * (x if self.input is None else self.input)


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    return model(x), lambda out: (out.sum(), {"value": out.detach().sum()})


class _Hub:
    """In-memory delivery between the stage threads, each message after a random delay."""

    def __init__(self, stages: int, seed: int) -> None:
        self.inboxes = [queue.Queue() for _ in range(stages)]
        self.arrivals: list[list[str]] = [[] for _ in range(stages)]
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.timers: list[threading.Timer] = []

    def deliver(self, rank: int, message: Message) -> None:
        def land() -> None:
            with self.lock:
                self.arrivals[rank].append(f"{message.header.kind}{message.header.microbatch}.c{message.header.chunk}")
            self.inboxes[rank].put(message)

        with self.lock:
            delay = self.random.uniform(0.0, 0.004)
        timer = threading.Timer(delay, land)
        self.timers.append(timer)
        timer.start()


class _Links(StageLinks):
    def __init__(self, hub: _Hub, rank: int, stages: int) -> None:
        self.hub, self.rank, self.stages = hub, rank, stages

    def send(self, direction, tensor, header) -> None:
        peer = (self.rank + (1 if direction == "next" else -1)) % self.stages  # the last stage wraps to chunk c+1
        self.hub.deliver(peer, Message(header, tensor.detach().clone(), self.rank))

    def poll(self):
        try:
            return self.hub.inboxes[self.rank].get_nowait()
        except queue.Empty:
            return None

    def wait_any(self, timeout: float):
        try:
            return self.hub.inboxes[self.rank].get(timeout=timeout)
        except queue.Empty as exc:
            raise TransportTimeout(f"rank {self.rank}: nothing arrived within {timeout}s") from exc

    def close(self) -> None:
        pass


class _RecordingTracer:
    """Records the compute spans the runtime opens around each executed op, in order."""

    enabled = True

    def __init__(self) -> None:
        self.ran: list[str] = []

    def span(self, name: str, cat: str, tid: str = "compute", **args):
        if cat in {op.value for op in Op}:
            self.ran.append(name)
        return contextlib.nullcontext(SimpleNamespace(set=lambda **kw: None))

    def record(self, *args, **kwargs) -> None:
        pass


def _run_pipeline(policy_name: str, stages: int, chunks: int, microbatches: int, seed: int):
    shape = PipelineShape(stages, microbatches, chunks)
    hub = _Hub(stages, seed)
    weights = [[1.0 + 0.1 * (c * stages + s) for c in range(chunks)] for s in range(stages)]
    models = [[ScaleChunk(w) for w in weights[s]] for s in range(stages)]
    policies = [make_policy(policy_name, shape, s) for s in range(stages)]
    tracers = [_RecordingTracer() for _ in range(stages)]
    losses: dict[int, list] = {}
    errors: list[BaseException] = []

    def stage(s: int) -> None:
        try:
            ctx = DppContext(topology=Topology(world_size=stages, rank=s, pipeline_parallel=stages,
                                               virtual_pipeline=chunks),
                             policy=policies[s], links=_Links(hub, s, stages), timeout_s=30.0,
                             microbatch_data=lambda m, c: torch.tensor(float(m + 1)), tracer=tracers[s],
                             split_backward=SplitBackward() if policies[s].split_backward else None)
            losses[s] = forward_backward_dpp(forward_step_func=_forward_step, data_iterator=None, model=models[s],
                                             num_microbatches=microbatches, seq_length=1, micro_batch_size=1,
                                             dpp_context=ctx)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=stage, args=(s,)) for s in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a stage thread did not finish"
    return shape, hub, models, policies, tracers, losses


CASES = [("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8), ("zb-h1", 4, 1, 8),
         ("zb-h1", 2, 1, 5)]


@pytest.mark.parametrize(("policy", "stages", "chunks", "microbatches"), CASES)
def test_the_runtime_runs_the_static_order_exactly_and_computes_the_reference(policy, stages, chunks, microbatches):
    reordered = False
    for seed in range(3):
        shape, hub, models, policies, tracers, losses = _run_pipeline(policy, stages, chunks, microbatches, seed)
        for s in range(stages):
            assert tracers[s].ran == [str(a) for a in policies[s].order], f"stage {s} left {policy}'s order"
        # The delays did scramble arrivals: some stage saw its inputs in another order than it used them.
        for s in range(stages):
            consumed = [f"{'act' if a.op is Op.F else 'grad'}{a.microbatch}.c{a.chunk}" for a in policies[s].order
                        if (a.op is Op.F and not shape.is_first_virtual(s, a.chunk))
                        or (a.op is not Op.F and a.op is not Op.W and not shape.is_last_virtual(s, a.chunk))]
            reordered |= hub.arrivals[s] != consumed
        # Maths: y_m = (prod of all weights) * (m + 1); loss = sum_m y_m / M.
        ws = [models[s][c].w for c in range(chunks) for s in range(stages)]
        product = torch.prod(torch.stack([w.detach() for w in ws]))
        values = [float(d["value"]) for d in losses[stages - 1]]
        assert values == pytest.approx([float(product) * (m + 1) for m in range(microbatches)], rel=1e-6)
        mean_x = sum(range(1, microbatches + 1)) / microbatches
        for w in ws:
            assert float(w.grad) == pytest.approx(float(product / w.detach()) * mean_x, rel=1e-6)
    assert reordered, "the delays never changed an arrival order: the test would not catch a reordering runtime"


@pytest.mark.parametrize(("policy", "stages", "chunks", "expected"), [
    ("1f1b", 4, 1, [(4,), (3,), (2,), (1,)]),
    ("zb-h1", 4, 1, [(4,), (4,), (4,), (4,)]),  # W holds the activations: every stage holds p
    ("interleaved", 2, 2, [(4, 2), (3, 1)]),
])
def test_graph_slots_of_a_static_order_are_what_it_holds_at_most(policy, stages, chunks, expected):
    shape = PipelineShape(stages, 16, chunks)
    slots = [graph_slots(make_policy(policy, shape, s), shape, s) for s in range(stages)]
    assert slots == expected
    # The dynamic policies keep their cap, for every chunk alike.
    assert graph_slots(make_policy("dpp", shape, 0), shape, 0) == (one_f_one_b_cap(shape, 0),) * chunks


def test_peak_held_counts_f_up_and_the_releasing_op_down() -> None:
    order = make_policy("zb-h1", PipelineShape(2, 3), 1).order
    assert peak_held_per_chunk(order, 1, split_backward=True) == (2,)
    assert peak_held_per_chunk(order, 1, split_backward=False) == (3,)  # no B: nothing released
