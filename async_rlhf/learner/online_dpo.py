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

The log-probs are those of the distribution the generators sampled from, softmax(logits / generator.temperature),
for the policy and the reference alike, as in every other objective (``batch.token_logprobs``).

With several learner ranks the loss of an optimizer step is the mean over every rank's pairs of that step: each
rank divides the sum over its own pairs by the step's pair count summed over the ranks, times the ranks (which
DeepSpeed's average of the gradients undoes), as the token objectives do with ``LossNorm``. Each rank's own mean
would weigh a pair by 1 / (pairs on its rank x ranks): a rank with one pair would count as much as one with ten.
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
                    label_smoothing: float = 0.0, step_pairs: float | None = None,
                    world: int = 1) -> tuple[Tensor, dict[str, float]]:
    """DPO on the pairs, from per-token log-probs [N, T] of the current policy and the reference.

    The loss is the mean over ``pairs``; with ``step_pairs`` (the pairs of the step on every rank) it is the sum
    over ``pairs`` divided by ``step_pairs / world`` instead (see the module docstring). The metrics are means
    over ``pairs`` either way. Without pairs the loss is ``0 * logp`` (still attached to the graph, so every
    data-parallel rank takes part in the gradient all-reduce) and the metrics say so.
    """
    if not pairs:
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        return (torch.where(mask > 0, logp, zero) * 0.0).sum(), {"dpo/pairs": 0.0}
    seq = sequence_logp(logp, mask)
    ref_seq = sequence_logp(ref_logp, mask)
    chosen = torch.tensor([c for c, _ in pairs], device=logp.device)
    rejected = torch.tensor([r for _, r in pairs], device=logp.device)
    loss, m = dpo_loss(seq[chosen], seq[rejected], ref_seq[chosen], ref_seq[rejected], beta, label_smoothing)
    if step_pairs is not None:  # the mean times len(pairs) is their sum
        loss = loss * (len(pairs) * world / step_pairs)
    metrics = {f"dpo/{k.replace('/', '_')}": v for k, v in m.items()}
    metrics["dpo/pairs"] = float(len(pairs))
    return loss, metrics
