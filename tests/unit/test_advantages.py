"""Hand-computed checks of the group advantage estimators and of GAE on ragged sequences."""

import math

import pytest
import torch

from async_rlhf.config import choices
from async_rlhf.learner.advantages import broadcast_to_tokens, gae, group_advantages

torch.set_num_threads(1)

REWARDS = [[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]]
# group 0: mean 1/3, population std sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2/9)
# group 1: mean 4,   population std sqrt((4 + 0 + 4) / 3) = sqrt(8/3)
S0, S1 = math.sqrt(2 / 9), math.sqrt(8 / 3)
# reinforce_pp: centred = [2/3, -1/3, -1/3, -2, 0, 2], batch mean 0,
# batch population std sqrt((4/9 + 1/9 + 1/9 + 4 + 0 + 4) / 6) = sqrt(13/9)
SB = math.sqrt(13 / 9)
EXPECTED = {
    "grpo": [[(2 / 3) / S0, (-1 / 3) / S0, (-1 / 3) / S0], [-2 / S1, 0.0, 2 / S1]],  # ~[1.414, -.707, -.707]
    "dr_grpo": [[2 / 3, -1 / 3, -1 / 3], [-2.0, 0.0, 2.0]],
    # leave-one-out: 1 - mean(0, 0); 0 - mean(1, 0); ... ; 2 - mean(4, 6); 4 - mean(2, 6); 6 - mean(2, 4)
    "rloo": [[1.0, -0.5, -0.5], [-3.0, 0.0, 3.0]],
    "reinforce_pp": [[(2 / 3) / SB, (-1 / 3) / SB, (-1 / 3) / SB], [-2 / SB, 0.0, 2 / SB]],
}


def test_every_configured_estimator_is_covered():
    assert set(choices("train.advantage")) == set(EXPECTED)


@pytest.mark.parametrize("estimator", sorted(EXPECTED))
def test_group_advantages_hand_values(estimator):
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), estimator)
    assert adv.shape == (2, 3)
    for got, want in zip(adv.tolist(), EXPECTED[estimator]):
        assert got == pytest.approx(want, abs=1e-5)


def test_grpo_known_numbers():
    adv = group_advantages(torch.tensor(REWARDS), "grpo")
    assert adv[0].tolist() == pytest.approx([1.414214, -0.707107, -0.707107], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([-1.224745, 0.0, 1.224745], abs=1e-5)


@pytest.mark.parametrize("estimator", sorted(EXPECTED))
def test_equal_reward_groups_get_zero(estimator):
    rewards = torch.tensor([[3.0, 3.0, 3.0], [0.1, 0.1, 0.1], [0.0, 1.0, 1.0]])
    adv = group_advantages(rewards, estimator)
    assert adv[:2].abs().max().item() == 0.0  # exactly zero, no eps-scaled round-off
    assert adv[2].abs().max().item() > 0.1
    assert group_advantages(rewards[:2], estimator).abs().max().item() == 0.0


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="rloo needs at least 2"):
        group_advantages(torch.tensor([[1.0], [0.0]]), "rloo")
    with pytest.raises(ValueError, match="grpo"):
        group_advantages(torch.tensor(REWARDS), "ppo")
    with pytest.raises(ValueError, match="shape"):
        group_advantages(torch.tensor([1.0, 0.0]), "grpo")


def test_integer_rewards_are_accepted():
    assert group_advantages(torch.tensor([[1, 0]]), "dr_grpo").tolist() == [[0.5, -0.5]]


def test_broadcast_to_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.tensor([2.0]), mask)


def test_gae_two_sequences_of_different_lengths():
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    # seq 0 (3 tokens): r = [0, 0, 1], V = [0.5, 0.6, 0.7]
    #   t2: delta = 1 + 0 - 0.7 = 0.3                   A2 = 0.3
    #   t1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03          A1 = 0.03 + 0.72 * 0.3 = 0.246
    #   t0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04          A0 = 0.04 + 0.72 * 0.246 = 0.21712
    # seq 1 (2 tokens + padding holding garbage): r = [0, 2], V = [1.0, 0.5]
    #   t1: delta = 2 + 0 - 0.5 = 1.5 (value after the last real token is 0)    A1 = 1.5
    #   t0: delta = 0 + 0.9 * 0.5 - 1.0 = -0.55          A0 = -0.55 + 0.72 * 1.5 = 0.53
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    assert adv.tolist()[0] == pytest.approx([0.21712, 0.246, 0.3])
    assert adv.tolist()[1] == pytest.approx([0.53, 1.5, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.71712, 0.846, 1.0])
    assert ret.tolist()[1] == pytest.approx([1.53, 2.0, 0.0])
    # the padding position is never read
    rewards[1, 2], values[1, 2] = float("nan"), float("inf")
    adv2, ret2 = gae(rewards, values, mask, gamma, lam)
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)


def test_gae_skips_mask_holes_like_a_compacted_row():
    rewards = torch.tensor([[0.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 3.0, 0.7]])
    holed, _ = gae(rewards, values, torch.tensor([[1.0, 0.0, 1.0]]), 0.9, 0.8)
    compact, _ = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.7]]), torch.ones(1, 2), 0.9, 0.8)
    # t1: 1 - 0.7 = 0.3; t0: 0.9 * 0.7 - 0.5 + 0.72 * 0.3 = 0.346
    assert compact.tolist()[0] == pytest.approx([0.346, 0.3])
    assert holed.tolist()[0] == pytest.approx([0.346, 0.0, 0.3])


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    assert ret.tolist()[0] == pytest.approx([6.0, 5.0, 3.0])  # undiscounted reward-to-go
    assert adv.tolist()[0] == pytest.approx([5.5, 4.5, 2.5])
