"""Observation tokens of a multi-turn sample get exactly zero gradient; generated tokens do not."""

import numpy as np
import torch

from async_rlhf.config import ObjectiveConfig
from async_rlhf.learner.batch import collate, token_logprobs
from async_rlhf.learner.objectives import policy_loss
from async_rlhf.types import Group, Sample


def multi_turn_sample(reward: float) -> Sample:
    #            turn 1   observation   turn 2
    ids = np.array([7, 8, 20, 21, 22, 9, 10], np.int32)
    mask = np.array([1, 1, 0, 0, 0, 1, 1], np.uint8)
    logp = np.where(mask == 1, -1.0, 0.0).astype(np.float32)
    rewards = np.array([0, -0.1, 0, 0, 0, 0, 1.0], np.float32)
    return Sample(ids, logp, np.zeros(7, np.int32), reward, "stop", loss_mask=mask, token_rewards=rewards)


def test_observation_columns_are_masked_and_get_no_gradient():
    torch.manual_seed(0)
    groups = [Group("g", np.array([3, 4, 5], np.int32), [multi_turn_sample(0.9), multi_turn_sample(-0.1)])]
    batch = collate(groups, pad_id=0, advantage="grpo")
    # completion token k sits at absolute position 3 + k, so in column 2 + k
    expected = np.zeros(9, np.float32)
    expected[2:9] = [1, 1, 0, 0, 0, 1, 1]
    assert batch.loss_mask[0].tolist() == expected.tolist()
    assert batch.num_tokens == 8 and batch.observation_tokens == 6
    assert torch.all(batch.behav_logp[batch.loss_mask == 0] == 0)  # observation mu is 0, never used
    vocab, hidden = 32, 16
    emb = torch.nn.Embedding(vocab, hidden)
    head = torch.nn.Linear(hidden, vocab)
    logits = head(emb(batch.input_ids))
    logits.retain_grad()
    logp = token_logprobs(logits, batch.input_ids)
    adv = batch.advantages.unsqueeze(1).expand_as(batch.behav_logp)
    for kind in ("ppo", "decoupled_ppo", "tis_token", "vtrace"):
        logits.grad = None
        # on-policy (mu = prox = theta) so that no trained token is clipped away
        loss, _ = policy_loss(logp, logp.detach(), logp.detach(), adv, batch.loss_mask, ObjectiveConfig(kind=kind))
        loss.backward(retain_graph=True)
        grad = logits.grad[:, :-1].abs().sum(-1)  # logits row t predicts column t
        observed = batch.loss_mask == 0
        assert torch.all(grad[observed] == 0), f"{kind}: observation or prompt columns got gradient"
        assert torch.all(grad[batch.loss_mask == 1] > 0), f"{kind}: a generated token got no gradient"
