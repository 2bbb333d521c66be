"""Loss functions hand back logged values that a schedule's in-place loss scaling cannot change."""

import torch

from trainer.model.steps import _bert_loss, _gpt_loss


def test_logged_gpt_loss_survives_in_place_scaling_of_the_loss():
    output = torch.tensor([[2.0, 4.0, 6.0]])  # per-token losses
    loss, logged = _gpt_loss(torch.tensor([[1.0, 1.0, 0.0]]), output)
    loss /= 16  # what megatron-core's forward_step does with num_microbatches=16
    assert logged["lm loss"].item() == 3.0 and loss.item() == 3.0 / 16


def test_logged_bert_losses_survive_in_place_scaling_of_the_loss():
    lm = torch.tensor([[1.0, 3.0]])
    sop = torch.tensor([[0.0, 0.0]])
    loss, logged = _bert_loss(torch.tensor([[1.0, 1.0]]), torch.tensor([1]), (lm, sop))
    loss /= 4
    assert logged["lm loss"].item() == 2.0
    assert abs(logged["sop loss"].item() - 0.6931) < 1e-3
