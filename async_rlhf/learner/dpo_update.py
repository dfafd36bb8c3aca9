"""The online DPO update of a learner rank (``train.algorithm=online_dpo``): pairs from each prompt group, a
frozen reference, ``train.minibatches`` optimizer steps. The loss and the pair choice are in ``online_dpo.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def online_dpo_update(engine: Any, ref_model: Any, cfg: Any, batch: Any, group_sizes: list[int],
                      phase: Callable[[str], Any], optimizer_step: Callable[[], None],
                      max_over_ranks: Callable[[int], int] | None = None) -> dict[str, float]:
    """Online DPO: best against worst completion of every prompt group, ``train.minibatches`` steps.

    Only the rows that are in a pair are forwarded; a batch without any pair (every group a tie) still
    takes one zero-gradient step. ``max_over_ranks`` (several data-parallel ranks): every rank takes as many
    steps as the rank with the most, the extra ones zero-gradient, and runs every forward of a step even with no
    pair in its chunk, so the ranks' collectives (ZeRO-3 gathers one in each forward) stay in lockstep.
    """
    import torch

    from async_rlhf.learner.batch import token_logprobs
    from async_rlhf.learner.online_dpo import online_dpo_loss, select_pairs

    dpo = cfg.train.dpo
    pairs = select_pairs(batch.rewards, group_sizes)
    k = max(1, min(cfg.train.minibatches, len(pairs)))
    if max_over_ranks is not None:
        k = max_over_ranks(k)
    chunks = [pairs[j::k] for j in range(k)]
    per_step: list[dict[str, float]] = []
    for chunk in chunks:
        rows = sorted({i for pair in chunk for i in pair}) or [0]
        local = {row: j for j, row in enumerate(rows)}
        ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
        with phase("forward_backward"):
            with torch.no_grad():
                ref_logp = token_logprobs(ref_model(input_ids=ids, attention_mask=attn).logits, ids)
            logp = token_logprobs(engine(input_ids=ids, attention_mask=attn).logits, ids)
            loss, m = online_dpo_loss(logp, ref_logp, batch.loss_mask[rows],
                                      [(local[c], local[r]) for c, r in chunk], dpo.beta, dpo.label_smoothing)
            engine.backward(loss)
        optimizer_step()
        m["optim/loss"] = float(loss.item())
        # the margin on the same pairs after the step: the step's own progress (a no-grad forward); with several
        # ranks a chunk without pairs forwards too, since a ZeRO-3 forward gathers the parameters on every rank
        if chunk or max_over_ranks is not None:
            with torch.no_grad():
                after = token_logprobs(engine(input_ids=ids, attention_mask=attn).logits, ids)
            if chunk:
                _, m_after = online_dpo_loss(after, ref_logp, batch.loss_mask[rows],
                                             [(local[c], local[r]) for c, r in chunk], dpo.beta)
                m["dpo/margin_after_step"] = m_after["dpo/reward_margin"]
        per_step.append(m)
    merged = {key: sum(m.get(key, 0.0) for m in per_step) / len(per_step) for key in per_step[0]}
    merged["dpo/pairs"] = float(len(pairs))
    merged["dpo/groups_with_pair"] = len(pairs) / max(1, len(group_sizes))
    return merged
