"""PPO with a critic: rewards from reward models (weighted), KL shaping, GAE targets, normalisation and clipping.

Per learner step, before the policy minibatches (no gradient)::

    score_i   = sum_k w_k * RM_k(prompt_i + completion_i) + task_weight * reward_i (the generator's reward)
    score_i   -> normalised by running mean/std (reward_norm), clipped to [-reward_clip, reward_clip]
    r_t       = -kl_coef * (log mu_t - log ref_t)   on every completion token (KL penalty in the reward)
    r_last   += score_i                              on the last completion token
    V_t       = critic values (the "old" values of value clipping)
    A, R      = gae(r, V, mask, gamma, lam)          -> A whitened over the batch's tokens, clipped
    policy:   the configured off-policy objective (train.objective.kind) with the token advantages A
    critic:   clipped value loss toward R, one optimizer step per policy minibatch

The behaviour log-probs mu (from vLLM) stand in for the sampling policy in the KL term: they are what
actually generated the tokens, whatever the staleness, and cost no forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from async_rlhf.config import parse_reward_models
from async_rlhf.learner.advantages import gae
from async_rlhf.learner.objectives import masked_mean


class RewardModels:
    """Weighted sum of the scores of one or more reward models, loaded where this object lives."""

    def __init__(self, spec: list[tuple[str, float]], dtype: torch.dtype) -> None:
        from transformers import AutoModelForSequenceClassification

        self.models = []
        for path, weight in spec:
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval()
            model.requires_grad_(False)
            self.models.append((model, weight))

    @torch.no_grad()
    def score(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[N] weighted score of each right-padded sequence, read at its last token that is not padding.

        A generated eos is turned into padding first: reward models are trained on prompt + completion
        without eos (``async_rlhf.offline.reward_model``), so the score is read at the completion's last
        real token whether or not generation stopped on eos.
        """
        total = torch.zeros(input_ids.shape[0], dtype=torch.float32)
        for model, weight in self.models:
            pad, eos = model.config.pad_token_id, model.config.eos_token_id
            ids, attn = input_ids, attention_mask
            if pad is not None and isinstance(eos, int):
                at_eos = ids == eos
                ids, attn = ids.masked_fill(at_eos, pad), attn.masked_fill(at_eos, 0)
            logits = model(input_ids=ids, attention_mask=attn).logits
            total += weight * logits[:, 0].float()
        return total


class RunningMoments:
    """Running mean and variance of every score seen so far (Chan et al.'s parallel update)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def update(self, x: Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        x64 = x.detach().to(torch.float64)
        b_mean = float(x64.mean())
        b_m2 = float(((x64 - b_mean) ** 2).sum())
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked positions; 0 elsewhere. A constant input gives 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    out = (x - mean) / torch.sqrt(var + eps)
    return torch.where(mask > 0, out, torch.zeros((), dtype=x.dtype))


def token_rewards(scores: Tensor, behav_logp: Tensor, ref_logp: Tensor | None, mask: Tensor,
                  kl_coef: float) -> tuple[Tensor, Tensor]:
    """[N, T] per-token rewards: -kl_coef * (mu - ref) on completion tokens, plus the score on the last one.

    Returns (rewards, per-token KL estimate mu - ref, 0 without a reference).
    """
    valid = mask > 0
    zero = torch.zeros((), dtype=torch.float32)
    kl = torch.zeros_like(behav_logp, dtype=torch.float32)
    if ref_logp is not None:
        kl = torch.where(valid, behav_logp.float() - ref_logp.float(), zero)
    rewards = -kl_coef * kl
    cols = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(valid, cols, torch.full_like(cols, -1)).max(dim=1).values
    has = last >= 0
    rows = torch.arange(mask.shape[0])[has]
    rewards[rows, last[has]] += scores[has].float()
    return rewards, kl


@dataclass
class PPOTargets:
    advantages: Tensor  # [N, T] token advantages for the policy loss
    returns: Tensor     # [N, T] value targets
    old_values: Tensor  # [N, T] critic values before this step's updates
    metrics: dict[str, float]


class PPOTrainer:
    """The parts of PPO that are not the policy loss: rewards, critic, GAE; one per learner rank."""

    def __init__(self, cfg: Any, policy_path: str, ds_config: dict[str, Any]) -> None:
        from async_rlhf.learner.critic import CriticEngine

        self.cfg = cfg.train.ppo
        critic_path = self.cfg.critic_path or policy_path
        self.critic = CriticEngine(critic_path, cfg.model.dtype, self.cfg.critic_lr, self.cfg.value_clip, ds_config)
        spec = parse_reward_models(self.cfg.reward_models)
        self.reward_models = RewardModels(spec, getattr(torch, cfg.model.dtype)) if spec else None
        self.moments = RunningMoments()

    def scores(self, batch: Any) -> Tensor:
        """[N] raw scores: reward models plus the weighted generator reward."""
        scores = self.cfg.generator_reward_weight * batch.rewards.float()
        if self.reward_models is not None:
            scores = scores + self.reward_models.score(batch.input_ids, batch.attention_mask)
        return scores

    @torch.no_grad()
    def prepare(self, batch: Any, ref_logp_fn: Callable[[], Tensor] | None) -> PPOTargets:
        p = self.cfg
        raw = self.scores(batch)
        scores = raw
        if p.reward_norm:
            self.moments.update(raw)
            scores = (raw - self.moments.mean) / max(self.moments.std, 1e-6)
        if p.reward_clip > 0:
            scores = scores.clamp(-p.reward_clip, p.reward_clip)
        mask = batch.loss_mask
        ref_logp = ref_logp_fn() if ref_logp_fn is not None and p.kl_coef > 0 else None
        rewards, kl = token_rewards(scores, batch.behav_logp, ref_logp, mask, p.kl_coef)
        values = self.critic.values(batch.input_ids, batch.attention_mask)
        adv, returns = gae(rewards, values, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            adv = whiten(adv, mask)
        if p.advantage_clip > 0:
            adv = adv.clamp(-p.advantage_clip, p.advantage_clip)
        metrics = {
            "ppo/score_raw_mean": float(raw.mean().item()),
            "ppo/score_mean": float(scores.mean().item()),
            "ppo/kl_behav_ref": float(masked_mean(kl, mask).item()),
            "ppo/advantage_abs_mean": float(masked_mean(adv.abs(), mask).item()),
            "ppo/old_values_mean": float(masked_mean(values, mask).item()),
            "ppo/returns_mean": float(masked_mean(returns, mask).item()),
        }
        return PPOTargets(adv, returns, values, metrics)

    def train_critic(self, batch: Any, idx: Tensor, targets: PPOTargets) -> dict[str, float]:
        return self.critic.update(batch.input_ids[idx], batch.attention_mask[idx], targets.old_values[idx],
                                  targets.returns[idx], batch.loss_mask[idx])
