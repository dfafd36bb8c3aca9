"""Asynchronous online DPO: preference pairs from the generators' own samples, ranked by the reward source.

Per prompt group (n completions of one prompt, all from the stream the buffer releases under the usual
staleness rule): chosen = the completion with the highest reward, rejected = the one with the lowest; a
group whose rewards are all equal gives no pair. The loss is DPO on summed completion log-probs against a
frozen reference (the initial policy). DPO needs no behaviour log-probs and no importance weights, which is
why the Asynchronous RLHF paper (Noukhovitch et al. 2024) found it the most robust objective to stale
samples: a stale pair is still a valid preference.

    rows of the batch:  g0: s0 s1 s2 s3 | g1: s4 s5 s6 s7 | ...
    rewards:                1  0  0  1  |     0  0  0  0
    pairs:              (s0, s1)        |     (none: a tie)
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_rlhf.learner.losses import dpo_loss, sequence_logp


def select_pairs(rewards: Tensor, group_sizes: list[int]) -> list[tuple[int, int]]:
    """(chosen row, rejected row) for every group of consecutive rows whose rewards are not all equal.

    The first row with the highest reward is chosen and the first row with the lowest is rejected, so the
    choice is deterministic.
    """
    if sum(group_sizes) != rewards.shape[0]:
        raise ValueError(f"group sizes {group_sizes} add up to {sum(group_sizes)}, but there are "
                         f"{rewards.shape[0]} rewards")
    pairs: list[tuple[int, int]] = []
    start = 0
    for n in group_sizes:
        r = rewards[start:start + n]
        if n >= 2 and r.max() > r.min():
            pairs.append((start + int(r.argmax()), start + int(r.argmin())))
        start += n
    return pairs


def online_dpo_loss(logp: Tensor, ref_logp: Tensor, mask: Tensor, pairs: list[tuple[int, int]], beta: float,
                    label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """DPO on the pairs, from per-token log-probs [N, T] of the current policy and the reference.

    Without pairs the loss is ``0 * logp`` (still attached to the graph, so every data-parallel rank
    takes part in the gradient all-reduce) and the metrics say so.
    """
    if not pairs:
        zero = torch.zeros((), dtype=logp.dtype)
        return (torch.where(mask > 0, logp, zero) * 0.0).sum(), {"dpo/pairs": 0.0}
    seq = sequence_logp(logp, mask)
    ref_seq = sequence_logp(ref_logp, mask)
    chosen = torch.tensor([c for c, _ in pairs])
    rejected = torch.tensor([r for _, r in pairs])
    loss, m = dpo_loss(seq[chosen], seq[rejected], ref_seq[chosen], ref_seq[rejected], beta, label_smoothing)
    metrics = {f"dpo/{k.replace('/', '_')}": v for k, v in m.items()}
    metrics["dpo/pairs"] = float(len(pairs))
    return loss, metrics
