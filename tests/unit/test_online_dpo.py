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


# ----------------------------------------------------------------------------- the update (issue 44, item 12)


class PlainEngine:
    """What online_dpo_update asks of its DeepSpeed engine, on a plain module: forward and a plain backward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


def _policy_and_ref(model_dir):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # a reference that differs from the policy
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ref.requires_grad_(False)
    return policy, ref


def _update(policy, ref, batch, sizes, overrides, reduce=None, agreement=None):
    """One online DPO update on plain torch; returns (the stepped gradient, metrics)."""
    import contextlib

    from async_rlhf.learner.dpo_update import online_dpo_update

    cfg = load_config(None, ["train.algorithm=online_dpo", "train.objective.kl_coef=0", *overrides])
    grads = []

    def step() -> None:
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
        policy.zero_grad(set_to_none=True)

    policy.zero_grad(set_to_none=True)
    m = online_dpo_update(PlainEngine(policy), ref, cfg, batch, sizes, lambda name: contextlib.nullcontext(), step,
                          sum_over_ranks=reduce, agreement=agreement)
    return grads, m


def _rows(batch, rows):
    from dataclasses import replace

    idx = torch.tensor(rows)
    return replace(batch, input_ids=batch.input_ids[idx], attention_mask=batch.attention_mask[idx],
                   loss_mask=batch.loss_mask[idx], behav_logp=batch.behav_logp[idx], versions=batch.versions[idx],
                   rewards=batch.rewards[idx], advantages=batch.advantages[idx], group_ids=[])


def test_online_dpo_is_a_mean_over_every_ranks_pairs(tiny_model_dir, ragged_batch):
    """Rank 0 holds two pairs, rank 1 one: the ranks' averaged gradient (DeepSpeed's) is that of one rank with all
    three, each pair weighing 1/3. Each rank's own mean weighed rank 1's pair 1/2 and rank 0's 1/4 (the defect)."""
    from test_advantage_reduce import on_ranks

    batch = ragged_batch(51)
    assert select_pairs(batch.rewards, [3, 3, 3]) == [(0, 1), (4, 3), (8, 6)]
    policy, ref = _policy_and_ref(tiny_model_dir)
    (want,), m = _update(policy, ref, batch, [3, 3, 3], [])
    assert m["dpo/pairs"] == 3.0
    copies = [_policy_and_ref(tiny_model_dir)[0] for _ in range(2)]
    halves = [(_rows(batch, list(range(6))), [3, 3]), (_rows(batch, [6, 7, 8]), [3])]
    got = on_ranks([lambda reduce, r=r: _update(copies[r], ref, *halves[r], [], reduce)[0][0] for r in (0, 1)])
    assert max(g.abs().max().item() for g in want.values()) > 1e-4
    for name, g in want.items():
        torch.testing.assert_close((got[0][name] + got[1][name]) / 2, g, rtol=1e-4, atol=1e-7, msg=name)
    # without the sum over ranks each rank takes its own mean (the defect): another gradient
    alone = [_update(copies[r], ref, *halves[r], [])[0][0] for r in (0, 1)]
    gap = max(((alone[0][n] + alone[1][n]) / 2 - g).abs().max().item() for n, g in want.items())
    assert gap > 0.1 * max(g.abs().max().item() for g in want.values())


def test_online_dpo_log_probs_are_tempered_and_feed_the_agreement_monitor(tiny_model_dir, ragged_batch):
    """At generator.temperature 0.7 the policy's and the reference's log-probs are of softmax(logits / 0.7), as the
    generators sampled: behaviour log-probs recorded that way agree with the learner's forward to float precision,
    and the first step's forward is what the agreement monitor reads."""
    from async_rlhf.learner.agreement import Agreement
    from async_rlhf.learner.batch import token_logprobs

    batch = ragged_batch(51)
    policy, ref = _policy_and_ref(tiny_model_dir)
    with torch.no_grad():  # what a generator at temperature 0.7 serving these weights (version 0) records
        behav = token_logprobs(policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                               batch.input_ids, temperature=0.7)
    batch.behav_logp = torch.where(batch.loss_mask > 0, behav, torch.zeros(()))
    agreement = Agreement(version=0)
    _, m = _update(policy, ref, batch, [3, 3, 3], ["generator.temperature=0.7"], agreement=agreement)
    pair_rows = [0, 1, 3, 4, 6, 8]
    tokens = float((batch.loss_mask[pair_rows] > 0).sum())
    assert agreement.same_tokens == tokens and agreement.ratio_tokens == tokens
    out = agreement.metrics()
    assert out["rollout/logp_mismatch_max"] < 1e-5 and out["rollout/is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # the loss is DPO on the tempered sequence log-probs (untempered ones give another loss)
    with torch.no_grad():
        out_p = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        out_r = ref(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # (the policy stepped nowhere: the stand-in optimizer only reads the gradient)
    for temperature, same in ((0.7, True), (1.0, False)):
        loss, _ = online_dpo_loss(token_logprobs(out_p, batch.input_ids, temperature=temperature),
                                  token_logprobs(out_r, batch.input_ids, temperature=temperature),
                                  batch.loss_mask, [(0, 1), (4, 3), (8, 6)], beta=0.1)
        assert (m["optim/loss"] == pytest.approx(loss.item(), rel=1e-5)) is same, temperature
