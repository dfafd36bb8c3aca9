"""Preference and reward-model losses against values worked out by hand (the arithmetic is in each test)."""

from __future__ import annotations

import math

import pytest
import torch

from async_rlhf.learner.losses import bradley_terry_loss, dpo_loss, kto_loss, sequence_logp


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sequence_logp_sums_masked_tokens_and_ignores_padding_values() -> None:
    token_logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("inf"), -0.25]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    out = sequence_logp(token_logp, mask)
    # row 0: -1 + -2 = -3; row 1: -0.5 + -0.25 = -0.75 (the inf under mask 0 is never read)
    assert torch.allclose(out, torch.tensor([-3.0, -0.75]))
    out.sum().backward()
    assert torch.equal(token_logp.grad, mask)  # d(sum)/d(token) is 1 on counted tokens, exactly 0 elsewhere


def test_sequence_logp_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one shape"):
        sequence_logp(torch.zeros(2, 3), torch.ones(2, 4))


def _dpo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pc = torch.tensor([-1.0], requires_grad=True)
    pr = torch.tensor([-3.0], requires_grad=True)
    return pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0])


def test_dpo_loss_value_gradient_and_metrics() -> None:
    pc, pr, rc, rr = _dpo_inputs()
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # chosen reward 0.5 * (-1 - -2) = 0.5; rejected 0.5 * (-3 - -2) = -0.5; h = 1
    # loss = -log sigmoid(1) = log(1 + e^-1) = 0.3132617
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    assert metrics["reward/chosen"] == pytest.approx(0.5)
    assert metrics["reward/rejected"] == pytest.approx(-0.5)
    assert metrics["reward/margin"] == pytest.approx(1.0)
    assert metrics["reward/accuracy"] == 1.0
    loss.backward()
    # dL/dpc = -beta * (1 - sigmoid(h)) = -0.5 * 0.2689414 = -0.1344707: descent raises the chosen log-prob
    assert pc.grad.item() == pytest.approx(-0.5 * (1 - _sigmoid(1.0)), abs=1e-6)
    assert pr.grad.item() == pytest.approx(0.5 * (1 - _sigmoid(1.0)), abs=1e-6)  # and lowers the rejected one


def test_dpo_label_smoothing_and_equal_policies() -> None:
    pc, pr, rc, rr = _dpo_inputs()
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    # 0.9 * log(1 + e^-1) + 0.1 * log(1 + e^1) = log(1 + e^-1) + 0.1 * 1   (log(1+e) - log(1+e^-1) = 1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)) + 0.1, abs=1e-6)
    same = torch.tensor([-2.0, -4.0])
    loss0, metrics0 = dpo_loss(same, same, same, same, beta=0.1)
    assert loss0.item() == pytest.approx(math.log(2.0), abs=1e-6)  # h = 0: -log(1/2)
    assert metrics0["reward/accuracy"] == 0.0  # ties are not counted as correct


def test_dpo_reference_gets_no_gradient_and_bad_arguments_are_named() -> None:
    pc, pr, _, _ = _dpo_inputs()
    rc = torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, rc, torch.tensor([-2.0]), beta=0.5)
    loss.backward()
    assert rc.grad is None
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rc, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rc, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="shape"):
        dpo_loss(pc, torch.zeros(2), rc, rc, beta=0.1)


def test_kto_loss_value_and_gradient_directions() -> None:
    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0])
    desirable = torch.tensor([True, False])
    loss, metrics = kto_loss(policy, ref, desirable, torch.tensor(0.5), beta=1.0)
    # log ratios r = [1, -1], z = 0.5
    # desirable:   1 - sigmoid(1 - 0.5)    = 1 - 0.6224593 = 0.3775407
    # undesirable: 1 - sigmoid(0.5 - (-1)) = 1 - 0.8175745 = 0.1824255;  mean = 0.2799831
    expected = ((1 - _sigmoid(0.5)) + (1 - _sigmoid(1.5))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["reward/desirable"] == pytest.approx(1.0)
    assert metrics["reward/undesirable"] == pytest.approx(-1.0)
    loss.backward()
    # desirable: d/dr [1 - sigmoid(r - z)] / 2 = -sigmoid'(0.5) / 2 = -0.1175019 (descent raises its log-prob)
    assert policy.grad[0].item() == pytest.approx(-_sigmoid(0.5) * (1 - _sigmoid(0.5)) / 2, abs=1e-6)
    # undesirable: d/dr [1 - sigmoid(z - r)] / 2 = +sigmoid'(1.5) / 2 = +0.0745733 (descent lowers it)
    assert policy.grad[1].item() == pytest.approx(_sigmoid(1.5) * (1 - _sigmoid(1.5)) / 2, abs=1e-6)


def test_kto_weights_and_negative_reference_point_clamped() -> None:
    policy = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-2.0, -1.0])
    desirable = torch.tensor([True, False])
    loss, _ = kto_loss(policy, ref, desirable, torch.tensor(0.5), beta=1.0, desirable_weight=2.0)
    # (2 * 0.3775407 + 0.1824255) / 2 = 0.4687535
    assert loss.item() == pytest.approx((2 * (1 - _sigmoid(0.5)) + (1 - _sigmoid(1.5))) / 2, abs=1e-6)
    loss_neg, metrics = kto_loss(policy, ref, desirable, torch.tensor(-3.0), beta=1.0)
    # z = max(-3, 0) = 0: (1 - sigmoid(1)) + (1 - sigmoid(1)) over 2 = 0.2689414
    assert loss_neg.item() == pytest.approx(1 - _sigmoid(1.0), abs=1e-6)
    assert metrics["reward/kl_ref_point"] == 0.0
    with pytest.raises(ValueError, match="bool"):
        kto_loss(policy, ref, torch.tensor([1, 0]), torch.tensor(0.0), beta=1.0)
    with pytest.raises(ValueError, match="scalar"):
        kto_loss(policy, ref, desirable, torch.zeros(2), beta=1.0)


def test_bradley_terry_value_gradient_margin() -> None:
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0], requires_grad=True)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    # differences [1, -1]: (log(1 + e^-1) + log(1 + e^1)) / 2 = (0.3132617 + 1.3132617) / 2 = 0.8132617
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.e)) / 2, abs=1e-6)
    assert metrics["reward/accuracy"] == 0.5
    assert metrics["reward/margin"] == pytest.approx(0.0)
    loss.backward()
    # dL/dchosen_0 = -(1 - sigmoid(1)) / 2 = -0.1344707; dL/drejected_0 the opposite
    assert chosen.grad[0].item() == pytest.approx(-(1 - _sigmoid(1.0)) / 2, abs=1e-6)
    assert rejected.grad[0].item() == pytest.approx((1 - _sigmoid(1.0)) / 2, abs=1e-6)
    assert chosen.grad[1].item() < 0 and rejected.grad[1].item() > 0  # the wrong pair is pushed harder
    assert abs(chosen.grad[1].item()) > abs(chosen.grad[0].item())
    loss_m, _ = bradley_terry_loss(chosen.detach(), rejected.detach(), margin=torch.tensor([1.0, 0.0]))
    # differences minus margin [0, -1]: (log 2 + log(1 + e)) / 2 = 1.0032044
    assert loss_m.item() == pytest.approx((math.log(2) + math.log(1 + math.e)) / 2, abs=1e-6)
