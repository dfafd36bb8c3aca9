"""Policy objectives for asynchronous (off-policy) RL on language models, as pure tensor functions.

The generators sample with a behaviour policy mu (an older weight version, in vLLM); the learner
differentiates the current policy theta. Every objective here is a way to make that stale data usable:
plain PPO against mu, decoupled PPO (AReaL: trust region against a proximal policy, importance
correction mu -> proximal), truncated / masked importance sampling at token or sequence level, and a
V-trace-style critic-free policy gradient.

Per token t all inputs are float tensors of shape [B, T]:

* ``logp``: log pi_theta(a_t), the current policy (carries the gradient);
* ``prox_logp``: log pi_prox(a_t), the learner weights at the start of the update (treated as constant);
* ``behav_logp``: log mu(a_t), recorded by the generator (constant);
* ``advantages``: A_t (constant);
* ``mask``: 1.0 on trained completion tokens, 0 on padding, prompt and observation tokens.

Values under ``mask == 0`` are never read: they are replaced by 0 before any arithmetic, so padding
(even inf or nan) changes neither a loss nor a gradient. The mask is treated as binary (``mask > 0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # config.py is light, but this module needs nothing of it at run time
    from async_rlhf.config import ObjectiveConfig

KINDS: tuple[str, ...] = (
    "ppo", "decoupled_ppo", "decoupled_ppo_interp", "tis_token", "tis_seq", "mask_token", "mask_seq",
    "vtrace",
)
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
TRUNCATE_MODES: tuple[str, ...] = ("clamp", "mask")

LOG_RATIO_CLAMP = 20.0
"""|log pi_theta - log pi_ref| is clamped to this before exp() in the PPO ratio: exp(20) ~ 5e8 is far
beyond any clip range, and it keeps a pathological token from overflowing to inf (inf * 0 = nan)."""


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask > 0`` (weighted by ``mask``); 0 where nothing is masked in.

    Entries of ``x`` under ``mask == 0`` are ignored even if they are inf/nan, and an empty selection
    yields 0 instead of nan, so an all-padding row or batch cannot poison a loss.
    """
    valid = mask > 0
    num = torch.where(valid, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))
    den = torch.where(valid, mask, torch.zeros((), dtype=mask.dtype, device=mask.device)).to(x.dtype)
    if dim is None:
        num, den = num.sum(), den.sum()
    else:
        num, den = num.sum(dim), den.sum(dim)
    return num / torch.where(den > 0, den, torch.ones_like(den))


@dataclass(frozen=True)
class LossNorm:
    """The denominators of a loss reduction, counted over a whole optimizer step rather than one forward.

    With micro-batches (gradient accumulation) and data-parallel ranks, each forward's loss is its own sum
    divided by these step-wide counts, so the summed (and rank-averaged) gradient is that of one big batch.
    ``tokens``, ``seqs`` and ``rows`` are totals over every rank; ``world`` is the number of ranks whose
    gradients are averaged (each rank's loss is multiplied by it, which the average undoes).
    """

    tokens: float
    """Masked (trained) tokens of the step."""
    seqs: float
    """Sequences with at least one masked token."""
    rows: float
    """Sequences of the step, all of them (Dr.GRPO's B)."""
    max_tokens: int
    """Dr.GRPO's constant T: the longest completion the generators may produce (``generator.max_new_tokens``)."""
    world: int = 1
    """Data-parallel ranks whose gradients are averaged."""

    @staticmethod
    def of(mask: Tensor, max_tokens: int, world: int = 1) -> LossNorm:
        """The counts of one [B, T] mask (before any all-reduce)."""
        valid = mask > 0
        return LossNorm(float(valid.sum().item()), float(valid.any(dim=-1).sum().item()), float(mask.shape[0]),
                        max_tokens, world)


def aggregate(per_token_loss: Tensor, mask: Tensor, mode: str, norm: LossNorm | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    * ``token_mean``: sum over all masked tokens / number of masked tokens (every token weighs the same,
      so long sequences weigh more).
    * ``seq_mean_token_mean``: masked mean within each sequence, then mean over the sequences that have
      at least one masked token (every sequence weighs the same; rows with no trained token are padding
      rows and are not counted).
    * ``seq_mean_token_sum_norm`` (Dr.GRPO): sum over masked tokens / (B * T) with a constant T: no
      per-sequence length normalisation, so there is no length bias. T is ``norm.max_tokens`` (the
      generators' longest completion); without ``norm`` it falls back to ``mask.shape[1]``, which is only
      constant if the caller's width is.

    With ``norm`` the counts (masked tokens, sequences, B) are the step's, not this tensor's: see
    :class:`LossNorm`. Without it they are this tensor's, as one forward of the whole step.
    """
    valid = mask > 0
    zero = torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device)
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
    if norm is None:
        if mode == "token_mean":
            return masked_mean(per_token_loss, mask)
        if mode == "seq_mean_token_mean":
            per_seq = masked_mean(per_token_loss, mask, dim=-1)
            has_tokens = valid.any(dim=-1).to(per_seq.dtype)
            return masked_mean(per_seq, has_tokens)
        norm = LossNorm(0.0, 0.0, float(mask.shape[0]), int(mask.shape[1]))
    if mode == "seq_mean_token_mean":
        total = masked_mean(per_token_loss, mask, dim=-1).sum()
        count = norm.seqs
    else:
        total = torch.where(valid, per_token_loss * mask, zero).sum()
        count = norm.tokens if mode == "token_mean" else norm.rows * norm.max_tokens
    return total / (count / norm.world) if count > 0 else total * 0.0


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """Per-token [B, T] estimate of KL(pi || ref) from tokens sampled by (roughly) pi; 0 where masked out.

    Schulman's estimators with log_ratio = logp - ref_logp: k1 = log_ratio (unbiased, high variance, can
    be negative), k2 = 0.5 * log_ratio^2 (low variance, biased), k3 = exp(-log_ratio) - 1 + log_ratio
    (unbiased and always >= 0). The gradient flows through ``logp`` only.
    """
    valid = mask > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, logp, zero) - torch.where(valid, ref_logp.detach().to(logp.dtype), zero)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    elif estimator == "k3":
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    return torch.where(valid, kl, zero)


def entropy_from_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """Mean token entropy (nats) over the masked tokens of ``logits`` [B, T, V]; 0 if no token is masked in.

    Only masked-in positions are read (padding logits may hold anything), the sum runs in float32 or
    wider, and ``-inf`` logits (banned tokens) give 0 * log 0 = 0 rather than nan.
    """
    selected = logits[mask > 0]
    if selected.dtype not in (torch.float32, torch.float64):
        selected = selected.float()
    log_p = torch.log_softmax(selected, dim=-1)
    log_p = log_p.clamp(min=torch.finfo(log_p.dtype).min)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return entropy.sum() / max(int(entropy.numel()), 1)


def interpolate_prox(
    logp: Tensor,
    behav_logp: Tensor,
    token_versions: Tensor | None,
    current_version: int | None,
    prox_version: int | None,
) -> Tensor:
    """Approximate the proximal log-prob without a forward pass of the proximal weights (detached).

    prox ~= behav + alpha * (logp - behav), alpha = (prox_version - v_t) / (current_version - v_t),
    clipped to [0, 1] per token, where v_t is the version that generated token t; alpha = 1 when
    current_version == v_t (the token is on-policy, so prox = current). The log-prob is assumed to move
    linearly in the version number between the behaviour and the current weights.
    """
    missing = [
        name for name, value in (
            ("token_versions", token_versions), ("current_version", current_version),
            ("prox_version", prox_version),
        ) if value is None
    ]
    if missing:
        raise ValueError(
            "decoupled_ppo_interp interpolates the proximal log-prob by weight version and needs "
            f"token_versions ([B, T]), current_version and prox_version; missing: {', '.join(missing)}"
        )
    assert token_versions is not None and current_version is not None and prox_version is not None
    v = token_versions.to(device=logp.device, dtype=torch.float64)
    num = float(prox_version) - v
    den = float(current_version) - v
    on_policy = den == 0
    safe_den = torch.where(on_policy, torch.ones_like(den), den)
    alpha = torch.where(on_policy, torch.ones_like(v), num / safe_den)
    alpha = alpha.clamp(0.0, 1.0).to(logp.dtype)
    behav = behav_logp.detach()
    return (behav + alpha * (logp.detach() - behav)).detach()


def correction_saturated(metrics: dict[str, float], threshold: float = 0.2) -> bool:
    """True when the off-policy correction altered too many tokens (clamped at the cap plus dropped).

    A saturated correction means the data is so stale that the objective mostly ignores or truncates it:
    lower ``train.max_staleness`` or raise ``is_cap``.
    """
    altered = metrics.get("is_weight/frac_truncated", 0.0) + metrics.get("is_weight/frac_masked", 0.0)
    return altered > threshold


def _ppo_clip(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A) and where the clip was active.

    Written with ``where`` instead of ``minimum`` so that ties (r inside the range) carry the full
    gradient of the unclipped branch.
    """
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    clipped = surr_clipped < surr
    return -torch.where(clipped, surr_clipped, surr), clipped


def _ratio(logp: Tensor, ref: Tensor) -> Tensor:
    return torch.exp((logp - ref).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _log_bound(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _vtrace_weights(log_w: Tensor, valid: Tensor, log_cap: float) -> tuple[Tensor, Tensor, Tensor]:
    """V-trace weights rho_t * g_t for a terminal-reward sequence with a constant baseline.

    rho_t = min(is_cap, w_t), c_t = min(1, w_t), w_t = exp(prox - behav). With V(x_t) = b for every t
    (the group mean) and V after the last token L = 0, V-trace's policy-gradient advantage for token t is
    g_t * A with g_t = c_{t+1} ... c_{L-1} * rho_L for t < L and g_L = 1, i.e. the truncated traces of
    the tokens *after* t (they decided the return that A measures). Tokens with mask 0 (observations
    inside a multi-turn sequence) have no policy ratio and count as c = 1. Returns (rho, g, rho * g).
    """
    ones = torch.ones_like(log_w)
    rho = torch.where(valid, torch.exp(log_w.clamp(max=log_cap)), ones)
    c = torch.where(valid, torch.exp(log_w.clamp(max=0.0)), ones)
    valid_from_here = valid.flip(-1).cumsum(-1).flip(-1)  # masked tokens at positions >= t
    last = valid & (valid_from_here == 1)
    d = torch.where(last, rho, c)
    prod_from_here = d.flip(-1).cumprod(-1).flip(-1)  # prod_{i >= t} d_i
    g = torch.cat([prod_from_here[..., 1:], ones[..., :1]], dim=-1)  # prod_{i > t} d_i
    g = torch.where(valid, g, ones)
    return rho, g, rho * g


def policy_loss(
    logp: Tensor,
    prox_logp: Tensor | None,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: ObjectiveConfig,
    token_versions: Tensor | None = None,
    current_version: int | None = None,
    prox_version: int | None = None,
    norm: LossNorm | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar policy loss for ``cfg.kind`` reduced with ``cfg.aggregation``, and python-float metrics.

    With w_t = exp(prox_t - behav_t) (the behaviour importance weight, constant) and the PPO-clip term
    C_t(r) = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A):

    * ``ppo``: C_t(exp(logp - behav)), no correction.
    * ``decoupled_ppo``: w'_t * C_t(exp(logp - prox)); w' = min(w, is_cap) (``truncate_mode=clamp``) or
      w with tokens above is_cap dropped (``mask``).
    * ``decoupled_ppo_interp``: the same with prox from :func:`interpolate_prox` (``prox_logp`` unused).
    * ``tis_token``: min(w_t, is_cap) * C_t(exp(logp - prox)) (always clamps).
    * ``tis_seq``: min(exp(sum_t (prox - behav)), is_cap) per sequence, times C_t(exp(logp - prox)).
    * ``mask_token``: C_t(exp(logp - prox)), tokens with w outside [is_floor, is_cap] dropped, w not applied.
    * ``mask_seq``: as mask_token with the per-sequence geometric mean exp(mean_t (prox - behav)), so the
      band does not depend on the length; whole sequences outside it are dropped.
    * ``vtrace``: -rho_t * g_t * A_t * (logp - prox + 1), see :func:`_vtrace_weights`; the gradient is that
      of -rho g A logp, the constant (1 - prox) only makes the value -rho g A at logp = prox, comparable
      with the PPO family (whose value is -w A at ratio 1).

    Dropped tokens contribute 0 but stay in the aggregation's normaliser (as in AReaL): the loss scale
    does not jump when many tokens are dropped, and a fully dropped batch gives 0, not nan.
    ``norm`` gives the step-wide denominators when this call sees one micro-batch of the step (see
    :class:`LossNorm`); the metrics are always this call's own means.
    ``prox_logp`` may be None only for ``ppo`` (the metrics then use the current log-probs) and for
    ``decoupled_ppo_interp``.
    """
    kind = cfg.kind
    if kind not in KINDS:
        raise ValueError(f"unknown objective kind {kind!r}; expected one of {', '.join(KINDS)}")
    valid = mask > 0
    maskf = valid.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(valid, logp, zero)
    behav = torch.where(valid, behav_logp.detach().to(logp.dtype), zero)
    adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)

    if kind == "decoupled_ppo_interp":
        versions = None
        if token_versions is not None:  # padding gets the current version: alpha = 1, finite
            fill = float(current_version) if current_version is not None else 0.0
            versions = torch.where(valid, token_versions.to(device=logp.device, dtype=torch.float64), fill)
        prox = interpolate_prox(logp, behav, versions, current_version, prox_version)  # raises if missing
    elif prox_logp is None:
        if kind != "ppo":
            raise ValueError(f"objective kind {kind!r} needs prox_logp (the proximal policy's log-probs)")
        prox = logp.detach()
    else:
        prox = torch.where(valid, prox_logp.detach().to(logp.dtype), zero)

    log_w = prox - behav  # 0 on padding
    log_cap = _log_bound(cfg.is_cap)
    log_floor = _log_bound(cfg.is_floor)
    no = torch.zeros_like(valid)
    weight = maskf  # the constant weight multiplied into each token's loss (0 drops the token)
    truncated, dropped, clipped = no, no, no
    trace: Tensor | None = None

    if kind == "vtrace":
        ratio = _ratio(logp, prox)
        rho, trace, weight = _vtrace_weights(log_w, valid, log_cap)
        truncated = valid & (log_w > log_cap)
        per_token = -weight * adv * (logp - prox + 1.0)
    else:
        ratio = _ratio(logp, behav if kind == "ppo" else prox)
        per_token, clipped = _ppo_clip(ratio, adv, cfg.eps_low, cfg.eps_high)
        if kind in ("decoupled_ppo", "decoupled_ppo_interp"):
            if cfg.truncate_mode == "clamp":
                weight = torch.exp(log_w.clamp(max=log_cap))
                truncated = valid & (log_w > log_cap)
            elif cfg.truncate_mode == "mask":
                dropped = valid & (log_w > log_cap)
                weight = torch.where(dropped, zero, torch.exp(log_w.clamp(max=log_cap)))
            else:
                allowed = ", ".join(TRUNCATE_MODES)
                raise ValueError(f"unknown truncate_mode {cfg.truncate_mode!r}; expected one of {allowed}")
        elif kind == "tis_token":
            weight = torch.exp(log_w.clamp(max=log_cap))
            truncated = valid & (log_w > log_cap)
        elif kind == "tis_seq":
            seq_log_w = (log_w * maskf).sum(-1, keepdim=True).expand_as(log_w)
            weight = torch.exp(seq_log_w.clamp(max=log_cap))
            truncated = valid & (seq_log_w > log_cap)
        elif kind in ("mask_token", "mask_seq"):
            band_log_w = log_w if kind == "mask_token" else masked_mean(log_w, maskf, dim=-1).unsqueeze(-1)
            outside = (band_log_w > log_cap) | (band_log_w < log_floor)
            dropped = valid & outside
            weight = torch.where(dropped, zero, maskf)
        per_token = weight * per_token
    per_token = torch.where(valid, per_token, zero)
    loss = aggregate(per_token, maskf, cfg.aggregation, norm)
    metrics = _metrics(logp, prox, log_w, ratio, weight, valid, truncated, dropped, clipped, trace, log_cap)
    return loss, metrics


@torch.no_grad()
def _metrics(
    logp: Tensor,
    prox: Tensor,
    log_w: Tensor,
    ratio: Tensor,
    weight: Tensor,
    valid: Tensor,
    truncated: Tensor,
    dropped: Tensor,
    clipped: Tensor,
    trace: Tensor | None,
    log_cap: float,
) -> dict[str, float]:
    """Diagnostics, computed in float64 and returned with one device sync.

    ``is_weight/mean|max|min|frac_above_cap|kl_behav`` describe the raw behaviour weight w = exp(prox - mu)
    for every kind (also ``ppo``, which applies no correction), so any run shows how off-policy it is;
    ``kl_behav`` is the k3 estimate of KL(mu || prox). ``frac_truncated`` (weight clamped at the cap, token
    kept) and ``frac_masked`` (token dropped) are disjoint and describe what the objective did;
    ``applied_mean`` is the mean weight actually multiplied in. ``ppo/approx_kl`` is the k3 estimate
    (r - 1) - log r, r = exp(logp - prox), of KL(prox || current); ``ppo/ratio_mean`` and
    ``ppo/clip_frac`` refer to the ratio the clip acts on (against mu for ppo, against prox otherwise).
    """
    m = valid.to(torch.float64)
    n = m.sum()
    lw = log_w.detach().to(torch.float64)
    w = lw.exp()
    lr = (logp.detach() - prox).to(torch.float64)

    def mean(x: Tensor) -> Tensor:
        return masked_mean(x.to(torch.float64), m)

    inf = torch.tensor(math.inf, dtype=torch.float64, device=w.device)
    has = n > 0

    def lo(x: Tensor) -> Tensor:
        return torch.where(has, torch.where(valid, x.to(torch.float64), inf).min(), 0.0)

    def hi(x: Tensor) -> Tensor:
        return torch.where(has, torch.where(valid, x.to(torch.float64), -inf).max(), 0.0)
    stats: dict[str, Tensor] = {
        "is_weight/mean": mean(w),
        "is_weight/max": hi(w),
        "is_weight/min": lo(w),
        "is_weight/frac_above_cap": mean((lw > log_cap).to(torch.float64)),
        "is_weight/frac_truncated": mean(truncated.to(torch.float64)),
        "is_weight/frac_masked": mean(dropped.to(torch.float64)),
        "is_weight/applied_mean": mean(weight.detach()),
        "is_weight/kl_behav": mean(w - 1.0 - lw),
        "ppo/clip_frac": mean(clipped.to(torch.float64)),
        "ppo/approx_kl": mean(lr.exp() - 1.0 - lr),
        "ppo/ratio_mean": mean(ratio.detach()),
    }
    if trace is not None:
        stats["vtrace/trace_mean"] = mean(trace)
        stats["vtrace/trace_min"] = lo(trace)
    values = torch.stack(list(stats.values())).tolist()
    return dict(zip(stats.keys(), values))
