"""PPO with a critic: rewards from reward models (weighted), KL shaping, GAE targets, normalisation and clipping.

Per learner step, before the policy minibatches (no gradient)::

    score_i   = rm_weight * sum_k w_k * RM_k(prompt_i + completion_i) + task_weight * reward_i (the generator's reward)
    score_i   -> normalised by running mean/std (reward_norm), clipped to [-reward_clip, reward_clip]
    r_t       = -kl_coef * (log mu_t - log ref_t)   on every completion token (KL penalty in the reward)
    r_last   += score_i                              on the last completion token
    V_t       = critic values (the "old" values of value clipping)
    A, R      = gae(r, V, mask, gamma, lam)          -> A whitened over the batch's tokens, clipped
    policy:   the configured off-policy objective (train.objective.kind) with the token advantages A
    critic:   clipped value loss toward R, one optimizer step per policy minibatch

The behaviour log-probs mu (from vLLM) stand in for the sampling policy in the KL term: they are what
actually generated the tokens, whatever the staleness, and cost no forward pass.

With reward models, the generator's reward (the task's verifiable one under rewards.sources=task) is logged
beside their score whatever its weight (rollout/task_reward_mean, rollout/rm_score_mean, ppo/rm_task_corr):
a reward-model score that rises while the task reward does not is the reward model being gamed.

The critic's and the reward models' forwards (and the critic's backward) go through the policy's token budget
(``learner.max_tokens_per_micro_batch``): no forward of a step holds more tokens than the policy's.

With several learner ranks the running reward moments (``reward_norm``) and the critic's loss are those of the
whole step, every rank's scores and tokens, as the advantages' whitening is.

A checkpoint holds the critic (weights and optimizer, its own DeepSpeed checkpoint under ``critic/``) and the
running reward moments (``critic/moments-rank<R>.json``, the same on every rank), so a resume continues both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from async_rlhf.config import parse_reward_models
from async_rlhf.learner.advantages import Reducer, batch_moments, gae
from async_rlhf.learner.objectives import masked_mean


class RewardModels:
    """Weighted sum of the scores of one or more reward models, loaded where this object lives."""

    def __init__(self, spec: list[tuple[str, float]], dtype: torch.dtype, placer: Any = None,
                 max_tokens: int = 0) -> None:
        from transformers import AutoModelForSequenceClassification

        self.models = []
        for path, weight in spec:
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval()
            if placer is not None:  # the learner rank's device (learner/device.py)
                model = placer.module(model)
            model.requires_grad_(False)
            self.models.append((model, weight))
        self.max_tokens = max_tokens
        """``learner.max_tokens_per_micro_batch``: the most padded tokens of one forward (0: all rows at once)."""

    @torch.no_grad()
    def score(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[N] weighted score of each right-padded sequence, read at its last token that is not padding.

        The rows go through each model in micro-batches of at most ``max_tokens`` padded tokens (the policy's
        budget, ``learner/microbatch.py``), each cut to its own longest row: a row's score does not depend on
        the rows beside it. The reward models are plain modules on this rank (no ZeRO), so no rank waits on
        another's forwards.

        A generated eos is turned into padding first: reward models are trained on prompt + completion
        without eos (``async_rlhf.offline.reward_model``), so the score is read at the completion's last
        real token whether or not generation stopped on eos.
        """
        from async_rlhf.learner.microbatch import plan_micro_batches

        total = torch.zeros(input_ids.shape[0], dtype=torch.float32, device=input_ids.device)
        plan = plan_micro_batches(attention_mask.sum(dim=1).tolist(), self.max_tokens, pack=False)
        for model, weight in self.models:
            pad, eos = model.config.pad_token_id, model.config.eos_token_id
            ids, attn = input_ids, attention_mask
            if pad is not None and isinstance(eos, int):
                at_eos = ids == eos
                ids, attn = ids.masked_fill(at_eos, pad), attn.masked_fill(at_eos, 0)
            for rows in plan:
                idx = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
                width = int(attention_mask[idx].sum(dim=1).max().item())  # before eos became padding
                logits = model(input_ids=ids[idx, :width], attention_mask=attn[idx, :width]).logits
                total[idx] += weight * logits[:, 0].float()
        return total


class RunningMoments:
    """Running mean and variance of every score seen so far (Chan et al.'s parallel update).

    With several learner ranks each step's scores are those of every rank (``reduce`` in :meth:`update`), so every
    rank holds the same moments and normalises by them: a score means the same whichever rank trains it.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def update(self, x: Tensor, reduce: Reducer | None = None) -> None:
        """Add the scores ``x``; ``reduce`` (several ranks: a float64 sum over them, in place) adds every rank's
        scores of the step instead (collective: two all-reduces, on every rank, even one with no score).

        The batch's squared deviations are taken about the step's own mean (a second pass), not from a sum of
        squares, which would cancel catastrophically for scores far from 0."""
        x64 = x.detach().to(torch.float64).flatten()
        sums = torch.tensor([float(x64.numel()), float(x64.sum())], dtype=torch.float64)
        if reduce is not None:
            reduce(sums)
        n = int(round(sums[0].item()))
        b_mean = float(sums[1].item()) / n if n else 0.0
        dev = torch.tensor([float(((x64 - b_mean) ** 2).sum())], dtype=torch.float64)
        if reduce is not None:
            reduce(dev)
        if n == 0:
            return
        b_m2 = float(dev.item())
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0

    def state(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    @classmethod
    def merged(cls, states: list[dict[str, float]]) -> RunningMoments:
        """The moments of everything several trackers saw (one state: that tracker exactly)."""
        out = cls()
        for s in states:
            n = int(s["count"])
            if n == 0:
                continue
            total = out.count + n
            delta = float(s["mean"]) - out.mean
            out.mean += delta * n / total
            out.m2 += float(s["m2"]) + delta * delta * out.count * n / total
            out.count = total
        return out


def reward_mix_metrics(task: Tensor, rm: Tensor) -> dict[str, float]:
    """The generator's (task) reward and the reward models' score of the same samples, side by side: means,
    spreads and their Pearson correlation over the batch (0 when either is constant)."""
    t, r = task.detach().double().flatten(), rm.detach().double().flatten()
    t_std, r_std = float(t.std(unbiased=False)), float(r.std(unbiased=False))
    corr = 0.0
    if t_std > 1e-12 and r_std > 1e-12:
        corr = float(((t - t.mean()) * (r - r.mean())).mean()) / (t_std * r_std)
    return {"rollout/task_reward_mean": float(t.mean()), "rollout/rm_score_mean": float(r.mean()),
            "ppo/task_reward_std": t_std, "ppo/rm_score_std": r_std, "ppo/rm_task_corr": corr}


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, reduce: Reducer | None = None) -> Tensor:
    """(x - mean) / std over the masked positions; 0 elsewhere. A constant input gives 0.

    ``reduce`` (several learner ranks): mean and std over the masked positions of the whole step, every
    rank's rows (:func:`advantages.batch_moments`), so the result does not depend on the number of ranks.
    """
    mean, var = batch_moments(x, mask, reduce)
    out = ((x - mean) / torch.sqrt(var + eps)).to(x.dtype)
    return torch.where(mask > 0, out, torch.zeros((), dtype=x.dtype, device=x.device))


def token_rewards(scores: Tensor, behav_logp: Tensor, ref_logp: Tensor | None, mask: Tensor,
                  kl_coef: float) -> tuple[Tensor, Tensor]:
    """[N, T] per-token rewards: -kl_coef * (mu - ref) on completion tokens, plus the score on the last one.

    Returns (rewards, per-token KL estimate mu - ref, 0 without a reference).
    """
    valid = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    kl = torch.zeros_like(behav_logp, dtype=torch.float32)
    if ref_logp is not None:
        kl = torch.where(valid, behav_logp.float() - ref_logp.float(), zero)
    rewards = -kl_coef * kl
    cols = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, cols, torch.full_like(cols, -1)).max(dim=1).values
    has = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has]
    rewards[rows, last[has]] += scores[has].float()
    return rewards, kl


def _rank_collectives() -> tuple[Reducer | None, Any]:
    """``ranks.sum_over_ranks`` and ``ranks.max_over_ranks`` when this process is one of several learner ranks
    (the critic's DeepSpeed engine lives on their default group), else (None, None)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None, None
    from async_rlhf.learner.ranks import max_over_ranks, sum_over_ranks

    return sum_over_ranks, max_over_ranks


CRITIC_DIR = "critic"
"""Where a checkpoint keeps the critic and the reward moments."""


@dataclass
class PPOTargets:
    advantages: Tensor  # [N, T] token advantages for the policy loss
    returns: Tensor     # [N, T] value targets
    old_values: Tensor  # [N, T] critic values before this step's updates
    metrics: dict[str, float]


class PPOTrainer:
    """The parts of PPO that are not the policy loss: rewards, critic, GAE; one per learner rank."""

    def __init__(self, cfg: Any, policy_path: str, ds_config: dict[str, Any], placer: Any = None) -> None:
        from async_rlhf.learner.critic import CriticEngine

        self.cfg = cfg.train.ppo
        budget = cfg.learner.max_tokens_per_micro_batch  # the critic and the reward models forward under it too
        critic_path = self.cfg.critic_path or policy_path
        self.critic = CriticEngine(critic_path, cfg.model.dtype, self.cfg.critic_lr, self.cfg.value_clip, ds_config,
                                   cfg.learner.gradient_checkpointing, budget)
        spec = parse_reward_models(self.cfg.reward_models)
        self.reward_models = RewardModels(spec, getattr(torch, cfg.model.dtype), placer, budget) if spec else None
        self.moments = RunningMoments()
        self._sum_ranks, self._max_ranks = _rank_collectives()
        # ZeRO-3 gathers the critic's parameters in every forward: ranks agree on the count of no-grad ones too
        self._agree_no_grad = self._max_ranks if cfg.learner.zero_stage == 3 else None

    def scores(self, batch: Any) -> tuple[Tensor, dict[str, float]]:
        """[N] raw scores: the weighted reward models plus the weighted generator reward; and, with reward
        models, both parts side by side (:func:`reward_mix_metrics`)."""
        task = batch.rewards.float()
        scores = self.cfg.generator_reward_weight * task
        if self.reward_models is None:
            return scores, {}
        rm = self.reward_models.score(batch.input_ids, batch.attention_mask)
        return scores + self.cfg.reward_model_weight * rm, reward_mix_metrics(task, rm)

    @torch.no_grad()
    def prepare(self, batch: Any, ref_logp_fn: Callable[[], Tensor] | None,
                reduce: Reducer | None = None) -> PPOTargets:
        """Rewards, values and GAE targets of ``batch``; ``reduce`` (several ranks) whitens over the whole step."""
        p = self.cfg
        raw, mix = self.scores(batch)
        scores = raw
        if p.reward_norm:  # the moments of every rank's scores (the same on every rank)
            self.moments.update(raw, reduce)
            scores = (raw - self.moments.mean) / max(self.moments.std, 1e-6)
        if p.reward_clip > 0:
            scores = scores.clamp(-p.reward_clip, p.reward_clip)
        mask = batch.loss_mask
        ref_logp = ref_logp_fn() if ref_logp_fn is not None and p.kl_coef > 0 else None
        rewards, kl = token_rewards(scores, batch.behav_logp, ref_logp, mask, p.kl_coef)
        values = self.critic.values(batch.input_ids, batch.attention_mask, self._agree_no_grad)
        adv, returns = gae(rewards, values, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            adv = whiten(adv, mask, reduce=reduce)
        if p.advantage_clip > 0:
            adv = adv.clamp(-p.advantage_clip, p.advantage_clip)
        metrics = {
            "ppo/score_raw_mean": float(raw.mean().item()),
            "ppo/score_mean": float(scores.mean().item()),
            "ppo/kl_behav_ref": float(masked_mean(kl, mask).item()),
            "ppo/advantage_abs_mean": float(masked_mean(adv.abs(), mask).item()),
            "ppo/old_values_mean": float(masked_mean(values, mask).item()),
            "ppo/returns_mean": float(masked_mean(returns, mask).item()),
            **mix,
        }
        return PPOTargets(adv, returns, values, metrics)

    def train_critic(self, batch: Any, idx: Tensor, targets: PPOTargets) -> dict[str, float]:
        """One critic optimizer step on rows ``idx``: micro-batched under the token budget, the loss a mean over
        the step's tokens on every rank."""
        return self.critic.update(batch.input_ids[idx], batch.attention_mask[idx], targets.old_values[idx],
                                  targets.returns[idx], batch.loss_mask[idx], self._max_ranks, self._sum_ranks)

    def save(self, out_dir: Path, rank: int) -> None:
        """The critic (DeepSpeed checkpoint: weights and optimizer; collective on every rank) and this rank's
        reward moments (those of every rank's scores, the same on every rank) under ``out_dir/critic``."""
        critic_dir = out_dir / CRITIC_DIR
        self.critic.engine.save_checkpoint(str(critic_dir), tag="state")
        critic_dir.mkdir(parents=True, exist_ok=True)
        (critic_dir / f"moments-rank{rank}.json").write_text(json.dumps(self.moments.state()))

    def load(self, ckpt_dir: Path, rank: int) -> bool:
        """Restore what :meth:`save` wrote; False (nothing changed) for a checkpoint without a critic (written
        before checkpoints held it). The reward moments are the same in every rank's file (one of them is read),
        whatever the ranks now; files that differ (written when each rank kept its own) are merged, so every
        rank starts from the moments of every score seen."""
        critic_dir = ckpt_dir / CRITIC_DIR
        if not critic_dir.is_dir():
            return False
        path, _ = self.critic.engine.load_checkpoint(str(critic_dir), tag="state")
        if path is None:
            raise RuntimeError(f"{critic_dir}: DeepSpeed found no critic state to load")
        states = [json.loads(f.read_text()) for f in sorted(critic_dir.glob("moments-rank*.json"))]
        same = all(s == states[0] for s in states)
        self.moments = RunningMoments.merged(states[:1] if same else states)
        return True
