"""Preference and reward-model losses, as pure tensor functions (no distributed imports).

Every ``*_logp`` argument is a summed per-sequence log-probability of shape [B] (see :func:`sequence_logp`):
``policy_*`` carries the gradient, ``ref_*`` comes from a frozen reference model and is treated as constant.
Each loss returns ``(scalar loss, metrics)``; metrics are plain floats for logging (``reward/...`` and
``loss/...`` keys), computed without gradient.

The implicit reward of a sequence under DPO and KTO is ``beta * (log pi(y|x) - log pi_ref(y|x))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sequence_logp(token_logp: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``token_logp`` [B, T] over positions where ``mask > 0``: the log-probability of each sequence [B].

    Entries under ``mask == 0`` are never read (they may be inf/nan padding), so they change neither the sum
    nor its gradient.
    """
    if token_logp.shape != mask.shape:
        raise ValueError(f"token_logp {tuple(token_logp.shape)} and mask {tuple(mask.shape)} must have one shape")
    valid = mask > 0
    zero = torch.zeros((), dtype=token_logp.dtype, device=token_logp.device)
    return torch.where(valid, token_logp, zero).sum(dim=-1)


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"these tensors must share one shape [B]: {shapes}")


def dpo_loss(
    policy_chosen_logp: Tensor,
    policy_rejected_logp: Tensor,
    ref_chosen_logp: Tensor,
    ref_rejected_logp: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Direct Preference Optimization (Rafailov et al. 2023), mean over the batch.

    ``h = beta * ((pc - rc) - (pr - rr))``; ``loss = -(1 - eps) * log sigmoid(h) - eps * log sigmoid(-h)``.
    ``label_smoothing`` eps > 0 is the conservative variant: it assumes a fraction eps of labels are flipped.
    """
    if beta <= 0:
        raise ValueError(f"dpo beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo label_smoothing must be in [0, 0.5), got {label_smoothing}")
    _check_same_shape(policy_chosen_logp=policy_chosen_logp, policy_rejected_logp=policy_rejected_logp,
                      ref_chosen_logp=ref_chosen_logp, ref_rejected_logp=ref_rejected_logp)
    chosen_reward = beta * (policy_chosen_logp - ref_chosen_logp.detach())
    rejected_reward = beta * (policy_rejected_logp - ref_rejected_logp.detach())
    logits = chosen_reward - rejected_reward
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    loss = losses.mean()
    with torch.no_grad():
        metrics = {
            "loss/dpo": float(loss),
            "reward/chosen": float(chosen_reward.mean()),
            "reward/rejected": float(rejected_reward.mean()),
            "reward/margin": float(logits.mean()),
            "reward/accuracy": float((chosen_reward > rejected_reward).float().mean()),
            "logp/chosen": float(policy_chosen_logp.mean()),
            "logp/rejected": float(policy_rejected_logp.mean()),
        }
    return loss, metrics


def kto_loss(
    policy_logp: Tensor,
    ref_logp: Tensor,
    desirable: Tensor,
    kl_ref_point: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024), mean over the batch.

    With ``r = policy_logp - ref_logp`` and the reference point ``z = max(kl_ref_point, 0)`` (a scalar estimate
    of KL(pi || pi_ref), usually from mismatched prompt/completion pairs; no gradient flows through it):
    desirable examples lose ``w_d * (1 - sigmoid(beta * (r - z)))``, undesirable ones
    ``w_u * (1 - sigmoid(beta * (z - r)))``. ``desirable`` is a bool tensor [B].
    """
    if beta <= 0:
        raise ValueError(f"kto beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(f"kto weights must be >= 0, got {desirable_weight}, {undesirable_weight}")
    _check_same_shape(policy_logp=policy_logp, ref_logp=ref_logp, desirable=desirable)
    if desirable.dtype != torch.bool:
        raise ValueError(f"kto desirable must be a bool tensor, got {desirable.dtype}")
    if kl_ref_point.numel() != 1:
        raise ValueError(f"kto kl_ref_point must be a scalar, got shape {tuple(kl_ref_point.shape)}")
    z = kl_ref_point.detach().reshape(()).clamp(min=0).to(policy_logp.dtype)
    log_ratio = policy_logp - ref_logp.detach()
    desirable_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (log_ratio - z)))
    undesirable_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (z - log_ratio)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)
    loss = losses.mean()
    with torch.no_grad():
        rewards = beta * log_ratio
        n_des = int(desirable.sum())
        n_und = desirable.numel() - n_des
        metrics = {
            "loss/kto": float(loss),
            "reward/kl_ref_point": float(z),
            "reward/desirable": float(rewards[desirable].mean()) if n_des else 0.0,
            "reward/undesirable": float(rewards[~desirable].mean()) if n_und else 0.0,
            "reward/desirable_count": float(n_des),
            "reward/undesirable_count": float(n_und),
        }
    return loss, metrics


def bradley_terry_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, margin: Tensor | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Reward-model loss under the Bradley-Terry model: ``-log sigmoid(s_chosen - s_rejected - margin)``, mean.

    ``margin`` [B] (optional, e.g. Llama 2's preference strength) asks the chosen score to lead by at least that
    much before the loss flattens.
    """
    _check_same_shape(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    diff = chosen_scores - rejected_scores
    if margin is not None:
        _check_same_shape(chosen_scores=chosen_scores, margin=margin)
        diff = diff - margin.detach()
    loss = -F.logsigmoid(diff).mean()
    with torch.no_grad():
        raw = chosen_scores - rejected_scores
        metrics = {
            "loss/bradley_terry": float(loss),
            "reward/accuracy": float((raw > 0).float().mean()),
            "reward/margin": float(raw.mean()),
            "reward/chosen": float(chosen_scores.mean()),
            "reward/rejected": float(rejected_scores.mean()),
        }
    return loss, metrics
