"""collate and token_logprobs worked by hand on two ragged prompt groups."""

import math

import numpy as np
import pytest
import torch

from async_rlhf.learner.batch import collate, token_logprobs
from async_rlhf.types import Group, Sample

torch.set_num_threads(1)

PAD = 0


def sample(tokens, logprobs, versions, reward) -> Sample:
    return Sample(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32), np.asarray(versions, np.int32),
                  reward)


def two_groups() -> list[Group]:
    g1 = Group("g1", np.array([1, 2, 3], np.int32), [
        sample([10, 11], [-0.1, -0.2], [5, 5], 1.0),
        sample([12, 13, 14], [-0.3, -0.4, -0.5], [4, 5, 5], 0.0),
    ])
    g2 = Group("g2", np.array([4, 5], np.int32), [
        sample([20], [-1.0], [3], 0.0),
        sample([21, 22, 23, 24, 25], [-2.1, -2.2, -2.3, -2.4, -2.5], [3, 3, 4, 4, 5], 3.0),
    ])
    return [g1, g2]


def test_collate_layout():
    b = collate(two_groups(), pad_id=PAD, advantage="dr_grpo")
    # L = max(3+2, 3+3, 2+1, 2+5) = 7
    assert b.input_ids.tolist() == [
        [1, 2, 3, 10, 11, PAD, PAD],
        [1, 2, 3, 12, 13, 14, PAD],
        [4, 5, 20, PAD, PAD, PAD, PAD],
        [4, 5, 21, 22, 23, 24, 25],
    ]
    assert b.input_ids.dtype == torch.long
    assert b.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ]
    # column t is about token t+1: a completion token at position p lives in column p-1
    assert b.loss_mask.tolist() == [
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 1],
    ]
    assert b.loss_mask.shape == (4, 6) and b.loss_mask.is_floating_point()
    for i in range(4):  # mask marks exactly the columns whose next token is a completion token
        for t in range(6):
            is_completion = b.attention_mask[i, t + 1] == 1 and t + 1 >= (3 if i < 2 else 2)
            assert b.loss_mask[i, t] == float(is_completion)
    expected_mu = [
        [0, 0, -0.1, -0.2, 0, 0],
        [0, 0, -0.3, -0.4, -0.5, 0],
        [0, -1.0, 0, 0, 0, 0],
        [0, -2.1, -2.2, -2.3, -2.4, -2.5],
    ]
    torch.testing.assert_close(b.behav_logp, torch.tensor(expected_mu))
    assert b.versions.tolist() == [
        [0, 0, 5, 5, 0, 0],
        [0, 0, 4, 5, 5, 0],
        [0, 3, 0, 0, 0, 0],
        [0, 3, 3, 4, 4, 5],
    ]
    assert b.versions.dtype == torch.long
    assert b.num_tokens == 2 + 3 + 1 + 5
    assert b.group_ids == ["g1", "g2"]


def test_collate_rewards_and_advantages():
    b = collate(two_groups(), pad_id=PAD, advantage="dr_grpo")
    assert b.rewards.shape == (4,) and b.advantages.shape == (4,)
    assert b.rewards.tolist() == [1.0, 0.0, 0.0, 3.0]
    # dr_grpo: r - group mean; g1 mean 0.5, g2 mean 1.5
    torch.testing.assert_close(b.advantages, torch.tensor([0.5, -0.5, -1.5, 1.5]))
    b = collate(two_groups(), pad_id=PAD, advantage="grpo")
    # n = 2: +-1 per group (population std)
    torch.testing.assert_close(b.advantages, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)


def test_collate_reinforce_pp_normalises_over_the_whole_batch():
    # REINFORCE++ (see advantages.group_advantages): centre per group, then normalise over all G*n sequences.
    # centred = [0.5, -0.5, -1.5, 1.5], batch mean 0, population std sqrt((.25+.25+2.25+2.25)/4) = sqrt(1.25)
    b = collate(two_groups(), pad_id=PAD, advantage="reinforce_pp")
    s = math.sqrt(1.25)
    torch.testing.assert_close(b.advantages, torch.tensor([0.5 / s, -0.5 / s, -1.5 / s, 1.5 / s]),
                               atol=1e-5, rtol=0)


def test_collate_single_sequence_without_padding():
    g = Group("only", np.array([7], np.int32), [sample([8, 9], [-0.5, -0.25], [2, 2], 1.0),
                                                 sample([6, 5], [-0.1, -0.2], [1, 2], 1.0)])
    b = collate([g], pad_id=99, advantage="grpo")
    assert b.input_ids.tolist() == [[7, 8, 9], [7, 6, 5]]
    assert b.loss_mask.tolist() == [[1, 1], [1, 1]]
    assert b.versions.tolist() == [[2, 2], [1, 2]]
    assert b.advantages.tolist() == [0.0, 0.0]  # equal rewards carry no signal


def test_token_logprobs_by_hand():
    logits = torch.tensor([[[0.0, 1.0, 2.0],
                            [1.0, 1.0, 1.0],
                            [3.0, 0.0, -1.0],
                            [9.0, 9.0, 9.0]]])   # the last position predicts nothing
    ids = torch.tensor([[0, 2, 1, 0]])
    got = token_logprobs(logits, ids)
    assert got.shape == (1, 3)
    z0 = math.log(math.exp(0) + math.exp(1) + math.exp(2))
    z2 = math.log(math.exp(3) + math.exp(0) + math.exp(-1))
    expected = [2.0 - z0, -math.log(3.0), 3.0 - z2]  # next ids 2, 1, 0: logits 2, 1, 3
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_token_logprobs_matches_collate_columns():
    # a policy that puts all its mass on the true next token scores 0 on every column
    b = collate(two_groups(), pad_id=PAD, advantage="dr_grpo")
    n, length = b.input_ids.shape
    vocab = 30
    logits = torch.full((n, length, vocab), -1e4)
    for i in range(n):
        for t in range(length - 1):
            logits[i, t, b.input_ids[i, t + 1]] = 0.0
    lp = token_logprobs(logits, b.input_ids)
    assert lp.shape == b.loss_mask.shape
    torch.testing.assert_close(lp, torch.zeros_like(lp), atol=1e-4, rtol=0)
    # and a half-precision input is computed in float32
    assert token_logprobs(logits.half(), b.input_ids).dtype == torch.float32
