"""What the driver does with the training/inference agreement monitor (``rollout/logp_mismatch_*``, computed by
the learners: learner/agreement.py): the progress line's note, the stop rule ``run.max_logp_mismatch`` and the
summary.json figures (pure)."""

from __future__ import annotations

from typing import Any

SHOW_ABOVE = 1e-3
"""The progress line shows the mismatch once a step's mean exceeds this (fp32 on both sides reads ~1e-6)."""
LIKELY_CAUSES = ("a dtype difference between learner and engine (model.dtype, generator.dtype)",
                 "vLLM's prefix cache serving KV that older weights computed",
                 "the sampling temperature applied on one side only",
                 "a stale tied lm_head after a weight reload")


def _figures(rec: dict[str, Any]) -> tuple[float, float, int] | None:
    if "rollout/logp_mismatch_mean" not in rec:
        return None
    return (float(rec["rollout/logp_mismatch_mean"]), float(rec.get("rollout/logp_mismatch_max", 0.0)),
            int(rec.get("rollout/same_version_tokens", 0)))


def mismatch_note(rec: dict[str, Any]) -> str:
    """`` | logp mismatch 2.1e-02 (max 3.0e-01)`` for the progress line when the step's mean is above
    :data:`SHOW_ABOVE`, else empty."""
    got = _figures(rec)
    if got is None or got[2] == 0 or got[0] <= SHOW_ABOVE:
        return ""
    return f" | logp mismatch {got[0]:.1e} (max {got[1]:.1e})"


def mismatch_failure(rec: dict[str, Any], bound: float) -> str | None:
    """The one-line error that stops the run when the step's mean |log p_learner - log p_behaviour| over its
    same-version tokens exceeds ``bound`` (``run.max_logp_mismatch``; 0: never), else None. The mean, not the
    max: one token of a reduced-precision engine can be off by a nat while the policy as a whole agrees."""
    got = _figures(rec)
    if not bound or got is None or got[2] == 0 or got[0] <= bound:
        return None
    mean, top, tokens = got
    return (f"step {rec.get('step')}: the learner and the generators disagree on the log-probs of the same weights "
            f"by {mean:.3g} nat on average (max {top:.3g}, over {tokens} same-version tokens), above "
            f"run.max_logp_mismatch={bound:g}; likely causes: {'; '.join(LIKELY_CAUSES)}")


def agreement_summary(records: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """summary.json's ``logp_mismatch_mean`` (token-weighted over the run's same-version tokens),
    ``logp_mismatch_max``, ``same_version_tokens`` and ``sampled_logp_mean`` (token-weighted over every trained
    token); None where no step measured it (e.g. online DPO has no same-version forward)."""
    measured = [r for r in records if "rollout/logp_mismatch_mean" in r]
    tokens = sum(int(r.get("rollout/same_version_tokens", 0)) for r in measured)
    sampled = [r for r in records if "rollout/sampled_logp_mean" in r and r.get("rollout/tokens")]
    sampled_tokens = sum(int(r["rollout/tokens"]) for r in sampled)
    return {
        "logp_mismatch_mean": (sum(float(r["rollout/logp_mismatch_mean"]) * int(r.get("rollout/same_version_tokens", 0))
                                   for r in measured) / tokens) if tokens else None,
        "logp_mismatch_max": max((float(r["rollout/logp_mismatch_max"]) for r in measured), default=None)
        if tokens else None,
        "same_version_tokens": tokens,
        "sampled_logp_mean": (sum(float(r["rollout/sampled_logp_mean"]) * int(r["rollout/tokens"]) for r in sampled)
                              / sampled_tokens) if sampled_tokens else None,
    }
