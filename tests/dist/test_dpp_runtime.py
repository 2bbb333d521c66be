"""forward_backward_dpp in one process: microbatch data by index, Megatron's loss scaling and
grad-sync protocol, the watchdog's message, and the TP decision word format."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from trainer.launch.topology import Topology
from trainer.pipeline import DppContext, DppStallError, forward_backward_dpp, make_forward_backward_func
from trainer.pipeline.tp_decision import decode, encode
from trainer.schedule.core import Action, Op, PipelineShape
from trainer.schedule.registry import make_policy
from trainer.transport.base import StageLinks, TransportTimeout


def _config(**overrides) -> SimpleNamespace:
    base = dict(no_sync_func=None, grad_sync_func=None, finalize_model_grads_func=None, grad_scale_func=None,
                calculate_per_token_loss=False, deallocate_pipeline_outputs=True, enable_autocast=False)
    return SimpleNamespace(**{**base, **overrides})


class ScaleChunk(torch.nn.Module):
    """y = w * x for the one-stage tests; set_input_tensor is what megatron's schedules call."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def set_input_tensor(self, tensors) -> None:
        self.input = tensors[0]

    def forward(self, x):
        return self.w * x


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    return model(x), lambda out: (out.sum(), {"value": out.detach().sum()})


def test_one_stage_run_fetches_by_index_scales_by_m_and_syncs_grads_once() -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def no_sync():
        events.append("enter no_sync")
        yield
        events.append("exit no_sync")

    finalized = []
    config = _config(no_sync_func=no_sync,
                     finalize_model_grads_func=lambda model, tokens, **kw: finalized.append(len(model)))
    chunk = ScaleChunk(config)
    topo = Topology(world_size=1, rank=0)
    m = 4
    ctx = DppContext(topology=topo, policy=make_policy("dpp", PipelineShape(1, m), 0), links=None,
                     microbatch_data=lambda mb, c: torch.tensor(float(mb + 1)))
    losses = make_forward_backward_func(ctx)(forward_step_func=_forward_step, data_iterator=None, model=[chunk],
                                             num_microbatches=m, seq_length=1, micro_batch_size=1)
    # Loss dicts come back in microbatch order whatever the execution order: microbatch m saw data m+1.
    assert [float(d["value"]) for d in losses] == [2.0, 4.0, 6.0, 8.0]
    # d/dw sum_m (w * x_m) / M = (1+2+3+4)/4
    assert chunk.w.grad.item() == pytest.approx(2.5)
    assert events == ["enter no_sync", "exit no_sync"] and finalized == [1]


def test_forward_only_returns_losses_without_gradients() -> None:
    chunk = ScaleChunk(_config())
    ctx = DppContext(topology=Topology(world_size=1, rank=0), policy=make_policy("1f1b", PipelineShape(1, 3), 0),
                     links=None, microbatch_data=lambda mb, c: torch.tensor(1.0))
    out = forward_backward_dpp(forward_step_func=_forward_step, data_iterator=None, model=chunk, num_microbatches=3,
                               seq_length=1, micro_batch_size=1, forward_only=True, dpp_context=ctx)
    assert len(out) == 3 and chunk.w.grad is None


def test_without_context_the_error_says_how_to_bind_one() -> None:
    with pytest.raises(ValueError, match="make_forward_backward_func"):
        forward_backward_dpp(forward_step_func=_forward_step, data_iterator=None, model=[], num_microbatches=1,
                             seq_length=1, micro_batch_size=1)


class SilentLinks(StageLinks):
    """Links on which nothing ever arrives."""

    def send(self, direction, tensor, header) -> None:
        raise AssertionError("nothing should be sent")

    def poll(self):
        return None

    def wait_any(self, timeout: float):
        raise TransportTimeout(f"nothing arrived within {timeout}s")

    def close(self) -> None:
        pass


def test_watchdog_names_stage_rank_and_the_inputs_it_waits_for() -> None:
    topo = Topology(world_size=2, rank=1, pipeline_parallel=2)
    shape = PipelineShape(2, 3)
    ctx = DppContext(topology=topo, policy=make_policy("dpp", shape, 1), links=SilentLinks(), timeout_s=0.5,
                     microbatch_data=lambda mb, c: torch.tensor(1.0))
    with pytest.raises(DppStallError) as err:
        forward_backward_dpp(forward_step_func=_forward_step, data_iterator=None, model=[ScaleChunk(_config())],
                             num_microbatches=3, seq_length=1, micro_batch_size=1, dpp_context=ctx)
    text = str(err.value)
    assert "stage 1 (rank 1)" in text and "0/6 actions done" in text
    assert "activation m0.c0 from stage 0 chunk 0" in text and "activation m2.c0" in text


@pytest.mark.parametrize("action", [Action(Op.F, 0, 0), Action(Op.B, 123456, 3), Action(Op.W, (1 << 24) - 1, 255)])
def test_tp_decision_word_round_trips(action: Action) -> None:
    for generation in (1, 77, (1 << 20) - 1):
        assert decode(encode(generation, action)) == (generation, action)
