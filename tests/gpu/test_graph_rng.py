"""Dropout inside a CUDA graph of --dpp-cuda-graphs: every replay draws fresh masks, with eager dropout's
distribution, and the same seed replays the same sequence.

One process, one GPU: megatron's graph-safe RNG tracker (as trainer.train seeds it with graphs) and the
capture helper of trainer.pipeline.graph_rng, which registers the tracker's states with each graph.
The captured function draws as a transformer layer does: attention dropout inside the tracker's fork
(the TP-region state) and hidden dropout from the default generator.

    python -m pytest -m gpu tests/gpu/test_graph_rng.py -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

P = 0.1
REPLAYS = 3


def _masks(seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """(each replay's (TP-region mask, default-generator mask), an eager TP-region mask drawn after)."""
    from megatron.core import tensor_parallel

    from trainer.pipeline.graph_rng import capture

    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, tp_rank=0, ep_rank=0,
                                                    etp_rank=0, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    x = torch.ones(1024, 1024, device="cuda")
    stream = torch.cuda.Stream()

    def layer():
        with tracker.fork():
            attention = torch.nn.functional.dropout(x, P)
        return attention, torch.nn.functional.dropout(x, P)

    with torch.cuda.stream(stream):
        layer()  # warm-up, eagerly, as capture_slot's is
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture(graph, None, stream, draws=True):
        attention, hidden = layer()
    masks = []
    for _ in range(REPLAYS):
        graph.replay()
        masks.append(((attention != 0).clone(), (hidden != 0).clone()))
    eager = (layer()[0] != 0).clone()
    torch.cuda.synchronize()
    return masks, eager


def test_every_replay_draws_fresh_masks_reproducible_from_the_seed() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    masks, eager = _masks(1234)
    for i in range(REPLAYS):
        for j in range(i):
            assert not torch.equal(masks[i][0], masks[j][0]), f"replays {j} and {i} drew the same attention mask"
            assert not torch.equal(masks[i][1], masks[j][1]), f"replays {j} and {i} drew the same hidden mask"
        assert not torch.equal(masks[i][0], masks[i][1])  # two generators, two streams of numbers
        assert not torch.equal(masks[i][0], eager)
    # eager dropout's distribution: each element kept with probability 1 - p (1M elements: std 3e-4)
    for kept in [m.float().mean().item() for pair in masks for m in pair] + [eager.float().mean().item()]:
        assert kept == pytest.approx(1 - P, abs=3e-3)
    again, eager_again = _masks(1234)
    for (a, h), (a2, h2) in zip(masks, again, strict=True):
        assert torch.equal(a, a2) and torch.equal(h, h2)
    assert torch.equal(eager, eager_again)
    other, _ = _masks(4321)
    assert not torch.equal(other[0][0], masks[0][0])
