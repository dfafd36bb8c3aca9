"""Online DPO, the pure parts: pairs from prompt groups (ties skipped) and the loss on per-token log-probs."""

import math

import pytest
import torch

from async_rlhf.config import ConfigError, load_config
from async_rlhf.learner.online_dpo import online_dpo_loss, select_pairs

torch.set_num_threads(1)


def test_select_pairs_best_against_worst_and_ties_skipped():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0,  0.0, 0.0, 0.0, 0.0,  0.5, 0.2, 0.9])
    assert select_pairs(rewards, [4, 4, 3]) == [(0, 1), (10, 9)]
    assert select_pairs(torch.tensor([2.0]), [1]) == []
    with pytest.raises(ValueError, match="add up to"):
        select_pairs(rewards, [4, 4])


def test_online_dpo_loss_hand_value_and_gradient_direction():
    # rows: 0 chosen, 1 rejected, 2 unused; last column is padding holding garbage
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.5, 0.0], [-9.0, -9.0, -9.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -2.0, 0.0], [-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # sequence log-probs: policy chosen -3, rejected -1; reference chosen -4, rejected -0.5
    # h = beta * ((-3 + 4) - (-1 + 0.5)) = 0.1 * 1.5 = 0.15; loss = -log sigmoid(h) = log(1 + exp(-0.15))
    loss, m = online_dpo_loss(logp, ref, mask, [(0, 1)], beta=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.15)), abs=1e-6)
    assert m["dpo/pairs"] == 1.0
    assert m["dpo/reward_margin"] == pytest.approx(0.15, abs=1e-6)
    loss.backward()
    g = logp.grad
    assert (g[0, :2] < 0).all() and (g[1, :2] > 0).all()  # descent raises the chosen, lowers the rejected
    assert g[2].abs().sum().item() == 0.0 and g[0, 2].item() == 0.0
    # d loss / d logp_chosen = -beta * sigmoid(-h)
    assert g[0, 0].item() == pytest.approx(-0.1 / (1 + math.exp(0.15)), abs=1e-6)


def test_online_dpo_without_pairs_is_a_zero_step():
    logp = torch.randn(2, 3, requires_grad=True)
    loss, m = online_dpo_loss(logp, torch.zeros(2, 3), torch.ones(2, 3), [], beta=0.1)
    assert loss.item() == 0.0 and m == {"dpo/pairs": 0.0}
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum().item() == 0.0


def test_online_dpo_config():
    cfg = load_config(None, ["train.algorithm=online_dpo", "train.dpo.beta=0.2"])
    assert cfg.train.dpo.beta == 0.2
    with pytest.raises(ConfigError, match="group_size to 2"):
        load_config(None, ["train.algorithm=online_dpo", "train.group_size=1", "train.advantage=reinforce_pp"])
    with pytest.raises(ConfigError, match="beta"):
        load_config(None, ["train.algorithm=online_dpo", "train.dpo.beta=0"])
