"""The online DPO update of a learner rank (``train.algorithm=online_dpo``): pairs from each prompt group, a
frozen reference, ``train.minibatches`` optimizer steps. The loss and the pair choice are in ``online_dpo.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def online_dpo_update(engine: Any, ref_model: Any, cfg: Any, batch: Any, group_sizes: list[int],
                      phase: Callable[[str], Any], optimizer_step: Callable[[], None],
                      max_over_ranks: Callable[[int], int] | None = None,
                      sum_over_ranks: Callable[[Any], None] | None = None, agreement: Any = None) -> dict[str, float]:
    """Online DPO: best against worst completion of every prompt group, ``train.minibatches`` steps.

    Only the rows that are in a pair are forwarded; a batch without any pair (every group a tie) still
    takes one zero-gradient step. ``max_over_ranks`` (several data-parallel ranks): every rank takes as many
    steps as the rank with the most, the extra ones zero-gradient, and runs every forward of a step even with no
    pair in its chunk, so the ranks' collectives (ZeRO-3 gathers one in each forward) stay in lockstep.
    ``sum_over_ranks`` (several ranks): each step's loss is the mean over every rank's pairs of that step (one
    all-reduce of the pair count per step; ``online_dpo.py``).

    Log-probs are of softmax(logits / generator.temperature), the distribution the generators sampled from.
    ``agreement`` (learner/agreement.py) is fed the first step's forward, made at the step's starting weights:
    the rows of its pairs.
    """
    import torch

    from async_rlhf.learner.batch import token_logprobs
    from async_rlhf.learner.online_dpo import online_dpo_loss, select_pairs

    dpo = cfg.train.dpo
    temperature = cfg.generator.temperature
    pairs = select_pairs(batch.rewards, group_sizes)
    k = max(1, min(cfg.train.minibatches, len(pairs)))
    if max_over_ranks is not None:
        k = max_over_ranks(k)
    chunks = [pairs[j::k] for j in range(k)]
    per_step: list[dict[str, float]] = []
    for j, chunk in enumerate(chunks):
        rows = sorted({i for pair in chunk for i in pair}) or [0]
        local = {row: at for at, row in enumerate(rows)}
        ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
        with phase("forward_backward"):
            counts = torch.tensor([float(len(chunk)), 1.0], dtype=torch.float64)  # this step's pairs, ranks
            if sum_over_ranks is not None:
                sum_over_ranks(counts)
            step_pairs, world = float(counts[0].item()), int(round(counts[1].item()))
            with torch.no_grad():
                ref_logp = token_logprobs(ref_model(input_ids=ids, attention_mask=attn).logits, ids,
                                          temperature=temperature)
            logp = token_logprobs(engine(input_ids=ids, attention_mask=attn).logits, ids, temperature=temperature)
            if agreement is not None and j == 0 and chunk:
                agreement.observe(logp, batch.behav_logp[rows], batch.versions[rows], batch.loss_mask[rows])
            loss, m = online_dpo_loss(logp, ref_logp, batch.loss_mask[rows],
                                      [(local[c], local[r]) for c, r in chunk], dpo.beta, dpo.label_smoothing,
                                      step_pairs, world)
            engine.backward(loss)
        optimizer_step()
        m["optim/loss"] = float(loss.item())
        # the margin on the same pairs after the step: the step's own progress (a no-grad forward); with several
        # ranks a chunk without pairs forwards too, since a ZeRO-3 forward gathers the parameters on every rank
        if chunk or max_over_ranks is not None:
            with torch.no_grad():
                after = token_logprobs(engine(input_ids=ids, attention_mask=attn).logits, ids,
                                       temperature=temperature)
            if chunk:
                _, m_after = online_dpo_loss(after, ref_logp, batch.loss_mask[rows],
                                             [(local[c], local[r]) for c, r in chunk], dpo.beta)
                m["dpo/margin_after_step"] = m_after["dpo/reward_margin"]
        per_step.append(m)
    merged = {key: sum(m.get(key, 0.0) for m in per_step) / len(per_step) for key in per_step[0]}
    merged["dpo/pairs"] = float(len(pairs))
    merged["dpo/groups_with_pair"] = len(pairs) / max(1, len(group_sizes))
    return merged
