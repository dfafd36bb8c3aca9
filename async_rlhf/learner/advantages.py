"""Advantage estimators: critic-free group baselines (GRPO family) and GAE for PPO with a critic.

The group estimators turn the scalar rewards of n completions of the same prompt into one advantage per
completion; :func:`broadcast_to_tokens` spreads it over the completion's trained tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")

Reducer = Callable[[Tensor], None]
"""Sums a small float64 tensor over the learner's data-parallel ranks, in place (``ranks.sum_over_ranks``)."""


def batch_moments(x: Tensor, mask: Tensor | None = None, reduce: Reducer | None = None) -> tuple[Tensor, Tensor]:
    """Mean and population variance (float64 scalars) of ``x`` over the positions where ``mask > 0`` (weighted
    by ``mask``; every position without it), over the whole step when ``reduce`` sums across the ranks.

    One all-reduce of (weight, sum, sum of squares) in float64, so ranks holding parts of a step get the
    statistics of all of it: the advantages then do not depend on how many ranks share the step. Entries
    under ``mask == 0`` are never read (they may be inf or nan); nothing selected gives (0, 0).
    """
    x64 = x.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    if mask is None:
        w = torch.ones_like(x64)
    else:
        valid = mask > 0
        w = torch.where(valid, mask.to(torch.float64), zero)
        x64 = torch.where(valid, x64, zero)
    sums = torch.stack([w.sum(), (w * x64).sum(), (w * x64.square()).sum()])
    if reduce is not None:
        reduce(sums)
    total, s, sq = sums.unbind()
    if total.item() <= 0:
        return zero, zero
    mean = s / total
    return mean, (sq / total - mean.square()).clamp(min=0.0)


def group_advantages(rewards: Tensor, estimator: str, eps: float = 1e-6, reduce: Reducer | None = None) -> Tensor:
    """Sequence-level advantages [G, n] from rewards [G, n] (G prompt groups of n samples each).

    * ``grpo``: (r - mean_group) / (std_group + eps) with the population std (``unbiased=False``): the
      advantages of a group then have exactly unit variance, and a group of n = 2 gives +-1.
    * ``dr_grpo``: r - mean_group (Dr.GRPO drops the std division, which over-weights easy/hard prompts).
    * ``rloo``: r_i - mean of the other n - 1 samples (leave-one-out, an unbiased baseline); needs n >= 2.
    * ``reinforce_pp``: REINFORCE++ with a group baseline: r - mean_group, then normalised over the whole
      batch of G * n sequences by its mean and population std (sequence level, so long completions do
      not weigh more in the statistics). With ``reduce`` (several learner ranks) the batch is the whole
      step's, every rank's groups (:func:`batch_moments`); the other estimators are per group already.

    A group whose rewards are all equal carries no learning signal and gets exactly 0 (for every
    estimator; float round-off in the mean would otherwise leave tiny values, which grpo's division by a
    tiny std would blow up).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [groups, samples_per_group], got {tuple(rewards.shape)}")
    if estimator not in ESTIMATORS:
        allowed = ", ".join(ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {allowed}")
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    n = r.shape[1]
    mean = r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv = (r - mean) / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    elif estimator == "dr_grpo":
        adv = r - mean
    elif estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs at least 2 samples per group (leave-one-out baseline)")
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    else:  # reinforce_pp
        centred = r - mean
        c_mean, c_var = batch_moments(centred, reduce=reduce)
        adv = ((centred - c_mean) / (c_var.sqrt() + eps)).to(centred.dtype)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(adv), adv)


def broadcast_to_tokens(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """[N] sequence advantages -> [N, T] token advantages: the value on every masked token, 0 elsewhere."""
    if seq_adv.dim() != 1 or mask.dim() != 2 or seq_adv.shape[0] != mask.shape[0]:
        raise ValueError(
            f"broadcast_to_tokens wants seq_adv [N] and mask [N, T], got {tuple(seq_adv.shape)} and "
            f"{tuple(mask.shape)}"
        )
    values = seq_adv[:, None].expand(mask.shape)
    return torch.where(mask > 0, values, torch.zeros((), dtype=seq_adv.dtype, device=seq_adv.device))


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation on [B, T] token rewards and values; returns (advantages, returns).

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, returns = A + V. Only
    positions with mask > 0 take part: "next" is the next masked-in token of the same row, and the value
    after a row's last masked-in token is 0 (the episode ends there). This covers right padding of
    sequences of different lengths, and also skips mask-0 holes (e.g. observation tokens) as if the row
    were compacted. Masked-out positions get advantage and return 0. Computed without gradient (the
    results are regression and policy targets).
    """
    valid = mask > 0
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    r = torch.where(valid, rewards.to(dtype), zero)
    v = torch.where(valid, values.to(dtype), zero)
    batch, length = r.shape
    advantages = torch.zeros_like(r)
    next_value = torch.zeros(batch, dtype=dtype, device=r.device)
    next_adv = torch.zeros(batch, dtype=dtype, device=r.device)
    for t in range(length - 1, -1, -1):
        m = valid[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(m, a, zero)
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = torch.where(valid, advantages + v, zero)
    return advantages, returns
