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

from async_rlhf.learner.advantages import Reducer, group_advantages
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


def collate(groups: list[Group], pad_id: int, advantage: str, reduce: Reducer | None = None) -> Batch:
    """``reduce`` (several learner ranks: a sum over them, in place) makes batch-level advantage statistics
    (REINFORCE++) those of the whole step, every rank's groups, not this rank's share."""
    seqs, comp_spans, mus, vers, trained = [], [], [], [], []
    rewards = [torch.tensor([s.reward for s in g.samples], dtype=torch.float32) for g in groups]
    if len({len(r) for r in rewards}) == 1:  # one [G, n] call: batch-level estimators (REINFORCE++) need it
        advs = list(group_advantages(torch.stack(rewards), advantage, reduce=reduce))
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


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, chunk_tokens: int = 0,
                   temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of each next token: [N, L, V] logits and [N, L] ids -> [N, L-1], in float32 (or wider).

    ``temperature``: of log_softmax(logits / temperature), the distribution the generators sample from
    (``generator.temperature``; vLLM returns the same, see ``generator/engine_args.py``). At 1 nothing is divided:
    the values are those of the plain log-softmax, bit for bit.

    ``chunk_tokens > 0`` never builds the [N, L-1, V] log-softmax: it takes a logsumexp per chunk of that
    many token positions and gathers the picked logit (:class:`_ChunkedLogprob`), and its backward writes
    the gradient chunk by chunk, so only the logits and their gradient are ever full size. Same values.
    """
    if chunk_tokens <= 0:
        logp = torch.log_softmax(_tempered(logits[:, :-1].float(), temperature), dim=-1)
        return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    n, length, vocab = logits.shape
    # every position of the contiguous [N*L, V] view (no copy); the last column predicts nothing and is dropped
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1).reshape(-1)
    flat = _ChunkedLogprob.apply(logits.reshape(n * length, vocab), targets, chunk_tokens, float(temperature))
    return flat.view(n, length)[:, :-1]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _tempered(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / temperature``, or ``x`` itself at 1 (no division: bit for bit the untempered values)."""
    return x if temperature == 1.0 else x / temperature


class _ChunkedLogprob(torch.autograd.Function):
    """logits [T, V], targets [T] -> log softmax(logits / temp)[t, targets[t]] [T], chunk by chunk.

    Forward keeps only the per-token logsumexp; backward recomputes each chunk's softmax from the saved
    logits: d logp_t / d logits_t = (onehot(target_t) - softmax(logits_t / temp)) / temp.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int,  # type: ignore[override]
                temperature: float = 1.0) -> torch.Tensor:
        dtype = _compute_dtype(logits.dtype)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        out = torch.empty_like(lse)
        for s in range(0, logits.shape[0], chunk):
            x = _tempered(logits[s:s + chunk].to(dtype), temperature)
            lse[s:s + chunk] = torch.logsumexp(x, dim=-1)
            out[s:s + chunk] = x.gather(-1, targets[s:s + chunk].unsqueeze(-1)).squeeze(-1) - lse[s:s + chunk]
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        temp = ctx.temperature
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            g = _tempered(grad_out[s:s + ctx.chunk].unsqueeze(-1).to(lse.dtype), temp)
            x = _tempered(logits[s:s + ctx.chunk].to(lse.dtype), temp)
            part = torch.exp(x - lse[s:s + ctx.chunk].unsqueeze(-1)) * -g
            part.scatter_add_(-1, targets[s:s + ctx.chunk].unsqueeze(-1), g)
            grad[s:s + ctx.chunk] = part.to(grad.dtype)
        return grad, None, None, None


@torch.no_grad()
def entropy_sum(logits: torch.Tensor, positions: torch.Tensor, chunk_tokens: int = 0,
                temperature: float = 1.0) -> float:
    """Summed entropy (nats) of the next-token distributions softmax(logits / temperature) at ``positions``
    (indices into the rows of the [T, V] ``logits``), without gradient; ``chunk_tokens > 0`` takes that many
    positions at a time instead of all of them at once. ``-inf`` logits give 0 * log 0 = 0."""
    dtype = _compute_dtype(logits.dtype)
    step = chunk_tokens if chunk_tokens > 0 else max(1, positions.numel())
    total = 0.0
    for s in range(0, positions.numel(), step):
        log_p = torch.log_softmax(_tempered(logits[positions[s:s + step]].to(dtype), temperature), dim=-1)
        log_p = log_p.clamp(min=torch.finfo(dtype).min)
        total += float(-(log_p.exp() * log_p).sum().item())
    return total
