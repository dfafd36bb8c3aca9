"""PPO's critic and reward models under the learner's token budget (issue 44, defect 8): their forwards (and the
critic's backward) are micro-batched like the policy's, with the results of one whole-batch forward: values,
scores, the critic's loss, metrics and gradient. Plain torch: the critic's DeepSpeed engine is replaced by the
few calls CriticEngine makes of it (forward, backward, the accumulation boundary, step), which count the forwards
and keep the stepped gradient; through real DeepSpeed ranks: tests/distributed/test_ppo_ranks.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from async_rlhf.learner.critic import CriticEngine, ValueModel
from async_rlhf.learner.ppo import RewardModels

torch.set_num_threads(1)

BUDGETS = (0, 40, 16, 1)
"""Unlimited, then smaller and smaller: 1 token gives every row a forward of its own."""


class PlainEngine:
    """What CriticEngine asks of its DeepSpeed engine, on a plain module: a forward counter, plain backward, and the
    gradient of the last optimizer step (then zeroed, as DeepSpeed's step does)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.forwards = 0
        self.boundaries: list[bool] = []
        self.stepped: dict[str, torch.Tensor] = {}

    def __call__(self, *args: Any) -> torch.Tensor:
        self.forwards += 1
        return self.module(*args)

    def train(self) -> None:
        self.module.train()

    def set_gradient_accumulation_boundary(self, last: bool) -> None:
        self.boundaries.append(last)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        loss.backward()

    def step(self) -> None:
        self.stepped = {n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None}
        self.module.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def value_model(tiny_model_dir) -> ValueModel:
    torch.manual_seed(0)
    model = ValueModel(str(tiny_model_dir), torch.float32)
    with torch.no_grad():  # a head that is not zero: values vary and the body gets a gradient
        model.head.weight.normal_(0.0, 0.5)
        model.head.bias.fill_(0.1)
    return model


def _critic(model: ValueModel, budget: int) -> tuple[CriticEngine, PlainEngine]:
    critic = CriticEngine.__new__(CriticEngine)  # no DeepSpeed: the engine's calls only
    engine = PlainEngine(model)
    critic.engine, critic.clip, critic.max_tokens = engine, 0.2, budget
    return critic, engine


def test_critic_values_and_update_equal_one_forward_under_any_budget(value_model, ragged_batch):
    batch = ragged_batch(value_model.body.config.vocab_size)
    mask = batch.loss_mask
    valid = mask > 0
    returns = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for budget in BUDGETS:
        critic, engine = _critic(value_model, budget)
        values = critic.values(batch.input_ids, batch.attention_mask)
        value_forwards = engine.forwards
        old = values - 0.5  # value clipping (0.2) active on part of the tokens
        engine.forwards = 0
        metrics = critic.update(batch.input_ids, batch.attention_mask, old, returns, mask)
        results[budget] = (values, value_forwards, engine.forwards, metrics, engine.stepped, engine.boundaries)
    values0, _, _, metrics0, grads0, _ = results[0]
    assert max(g.abs().max().item() for g in grads0.values()) > 1e-4  # a real gradient, body included
    assert grads0["body.layers.0.mlp.down_proj.weight"].abs().max().item() > 0
    assert 0 < metrics0["critic/clip_frac"] < 1
    for budget in BUDGETS[1:]:
        values, _, _, metrics, grads, boundaries = results[budget]
        torch.testing.assert_close(values[valid], values0[valid], rtol=1e-5, atol=1e-6, msg=f"budget {budget}")
        assert grads.keys() == grads0.keys()
        for name, g in grads.items():  # float32 sums in another order: within 1e-6 of the tensor's scale
            scale = grads0[name].abs().max().item()
            torch.testing.assert_close(g, grads0[name], rtol=1e-4, atol=1e-6 * scale, msg=f"budget {budget} {name}")
        for key in ("critic/value_loss", "critic/clip_frac", "critic/values_mean", "critic/explained_variance"):
            # float32 sums in another chunking: 1.2e-5 relative on a 2-core Xeon (2026-12-07), within 1e-5 on EPYC
            assert metrics[key] == pytest.approx(metrics0[key], rel=1e-4, abs=1e-7), (budget, key)
        assert boundaries == [False] * (len(boundaries) - 1) + [True]  # one accumulation boundary: the last
    # the budget is applied: fewer tokens per forward, more forwards (no-grad values and training alike)
    counts = [(results[b][1], results[b][2]) for b in BUDGETS]
    rows = batch.input_ids.shape[0]
    assert counts[0] == (1, 1) and counts[-1] == (rows, rows)
    assert counts == sorted(counts) and counts[1] < counts[2] < counts[3], counts
    assert results[16][3]["perf/critic_micro_batches"] == counts[2][1]


def test_critic_forwards_never_hold_more_than_the_budget(value_model, ragged_batch):
    batch = ragged_batch(value_model.body.config.vocab_size, seed=1)
    seen: list[int] = []
    hook = value_model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].numel()))
    try:
        critic, _ = _critic(value_model, 16)
        values = critic.values(batch.input_ids, batch.attention_mask)
        critic.update(batch.input_ids, batch.attention_mask, values, values + 1.0, batch.loss_mask)
    finally:
        hook.remove()
    longest = int(batch.attention_mask.sum(1).max())
    assert len(seen) > 2 and max(seen) <= max(16, longest)


def test_reward_model_scores_equal_one_forward_under_any_budget(tiny_model_dir, ragged_batch):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1).eval()
    assert rm.config.pad_token_id is not None
    rm.requires_grad_(False)
    batch = ragged_batch(rm.config.vocab_size, seed=2)
    ids = batch.input_ids.clone()
    ids[0, int(batch.attention_mask[0].sum()) - 1] = rm.config.eos_token_id  # an eos is read as padding
    forwards: list[int] = []
    hook = rm.register_forward_pre_hook(lambda mod, args, kwargs: forwards.append(kwargs["input_ids"].numel()),
                                        with_kwargs=True)
    scores, counts = {}, {}
    try:
        for budget in BUDGETS:
            models = RewardModels.__new__(RewardModels)  # the models loaded here, not from a path
            models.models, models.max_tokens = [(rm, 0.5)], budget
            forwards.clear()
            scores[budget] = models.score(ids, batch.attention_mask)
            counts[budget] = len(forwards)
            assert budget == 0 or max(forwards) <= max(budget, int(batch.attention_mask.sum(1).max()))
    finally:
        hook.remove()
    assert scores[0].abs().max().item() > 1e-3 and scores[0].std().item() > 1e-4
    for budget in BUDGETS[1:]:
        torch.testing.assert_close(scores[budget], scores[0], rtol=1e-5, atol=1e-6, msg=f"budget {budget}")
    # the budget is applied: more forwards as it shrinks, one per row at 1 token
    assert [counts[b] for b in BUDGETS] == sorted(counts[b] for b in BUDGETS)
    assert counts[0] == 1 < counts[40] < counts[16] < counts[1] == batch.input_ids.shape[0], counts
