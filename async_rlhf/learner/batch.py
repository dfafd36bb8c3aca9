"""From prompt groups to padded training tensors (pure; no distributed imports).

Sequence i is ``prompt_ids + completion_ids``, right-padded to L. Per-token tensors have L-1 columns:
column t holds what is known about token t+1 (the logit at t predicts it), so a completion token at
absolute position p lives in column p-1::

    input_ids   [ p0 p1 p2 c0 c1 c2 pad ]
    loss_mask      [ 0  0  1  1  1   0  ]   1 where the next token is a generated completion token
    behav_logp     [ .  .  m0 m1 m2  .  ]   mu from the generator
    versions       [ .  .  v0 v1 v2  .  ]   policy version that generated each token

A multi-turn sample's completion holds environment observation tokens between turns (``Sample.loss_mask``
0 there): their columns keep loss_mask 0, so no objective gives them gradient, while they stay in
``input_ids`` as context for the later turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from async_rlhf.learner.advantages import group_advantages
from async_rlhf.types import Group


@dataclass
class Batch:
    input_ids: torch.Tensor       # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
    loss_mask: torch.Tensor       # [N, L-1] float
    behav_logp: torch.Tensor      # [N, L-1] float
    versions: torch.Tensor        # [N, L-1] long
    rewards: torch.Tensor         # [N] float
    advantages: torch.Tensor      # [N] float, sequence level
    group_ids: list[str]
    observation_tokens: int = 0
    """Environment tokens inside completions (multi-turn), in the context but masked out of the loss."""

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def collate(groups: list[Group], pad_id: int, advantage: str) -> Batch:
    seqs, comp_spans, mus, vers, trained = [], [], [], [], []
    rewards = [torch.tensor([s.reward for s in g.samples], dtype=torch.float32) for g in groups]
    if len({len(r) for r in rewards}) == 1:  # one [G, n] call: batch-level estimators (REINFORCE++) need it
        advs = list(group_advantages(torch.stack(rewards), advantage))
    elif advantage == "reinforce_pp":
        raise ValueError("train.advantage=reinforce_pp normalises over the batch and needs equal group sizes")
    else:
        advs = [group_advantages(r.unsqueeze(0), advantage).squeeze(0) for r in rewards]
    for g in groups:
        for s in g.samples:
            prompt = g.prompt_ids.tolist()
            seqs.append(prompt + s.completion_ids.tolist())
            comp_spans.append((len(prompt), len(s.completion_ids)))
            mus.append(torch.from_numpy(s.logprobs.astype("float32")))
            vers.append(torch.from_numpy(s.versions.astype("int64")))
            mask = getattr(s, "loss_mask", None)
            trained.append(None if mask is None else torch.from_numpy(mask.astype("float32")))
    n, length = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length - 1))
    behav = torch.zeros((n, length - 1))
    versions = torch.zeros((n, length - 1), dtype=torch.long)
    for i, seq in enumerate(seqs):
        input_ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, :len(seq)] = 1
        start, count = comp_spans[i]
        cols = slice(start - 1, start - 1 + count)
        loss_mask[i, cols] = 1.0 if trained[i] is None else trained[i]
        behav[i, cols] = mus[i]
        versions[i, cols] = vers[i]
    observed = sum(int((m == 0).sum().item()) for m in trained if m is not None)
    return Batch(input_ids, attention, loss_mask, behav, versions, torch.cat(rewards), torch.cat(advs),
                 [g.group_id for g in groups], observed)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token: [N, L, V] logits and [N, L] ids -> [N, L-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
