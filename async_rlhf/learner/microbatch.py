"""One optimizer step as micro-batches under a token budget, padded or packed, with step-wide loss normalisers.

    an optimizer step over rows R (this rank's minibatch):
      norm  = LossNorm of R's loss mask, summed over the data-parallel ranks (one all-reduce)
      plan  = R in micro-batches of at most learner.max_tokens_per_micro_batch forward tokens
              (padded: rows x the micro-batch's longest; packed: the sum of lengths), longest first,
              then empty entries up to the largest count of any rank (ZeRO-2/3 reduce on every backward,
              so every rank must run as many); an empty entry forwards one row with a zero loss
      for each micro-batch m: forward -> loss_m = (sum over m's tokens) / norm -> backward (accumulates)
      sum_m loss_m is the loss of R in one forward, so the accumulated gradient is the one-batch gradient

Packed (``learner.pack``): a micro-batch's sequences are laid end to end in one row, position ids restart at
0 for each; transformers builds a block-diagonal causal mask from such position ids when no attention mask
is passed (``masking_utils.find_packed_sequence_indices``, sdpa and eager), so no token attends across a
sequence boundary. The log-probs are mapped back to the padded [N, L-1] column layout of ``batch.py``,
so every objective runs unchanged::

    padded   [ a0 a1 a2 .  ]      packed   [ a0 a1 a2 b0 b1 b2 b3 ]   position ids [ 0 1 2 0 1 2 3 ]
             [ b0 b1 b2 b3 ]      logp cols  a1 a2 (b0) b1 b2 b3       (b0's column crosses the boundary: unused)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from async_rlhf.learner.batch import entropy_sum, token_logprobs
from async_rlhf.learner.objectives import LossNorm, aggregate, kl_penalty, policy_loss


@dataclass(frozen=True)
class ForwardOptions:
    """How the learner runs a forward (``learner.*``)."""

    pack: bool = False
    chunk_tokens: int = 0
    max_tokens: int = 0
    temperature: float = 1.0
    """``generator.temperature``: log-probs (and entropies) of softmax(logits / temperature), the distribution
    the generators sampled from (batch.token_logprobs)."""


def plan_micro_batches(lengths: list[int], budget: int, pack: bool) -> list[list[int]]:
    """Indices into ``lengths`` in micro-batches whose forward holds at most ``budget`` tokens (0: one batch).

    Longest first, so a padded micro-batch is as wide as its first row; a sequence longer than the budget
    gets a micro-batch of its own (it cannot be split).
    """
    if budget <= 0 or not lengths:
        return [list(range(len(lengths)))]
    plan: list[list[int]] = []
    current: list[int] = []
    cost = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        grown = cost + lengths[i] if pack else (len(current) + 1) * lengths[current[0] if current else i]
        if current and grown > budget:
            plan.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        cost = grown
    plan.append(current)
    return plan


def forward_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, opts: ForwardOptions,
                     entropy_mask: Tensor | None = None) -> tuple[Tensor, float]:
    """[n, L-1] next-token log-probs of right-padded rows, and the summed entropy (no gradient) over the
    columns where ``entropy_mask > 0`` (0.0 without it).

    Packed: the rows go end to end in one row with position ids restarting per sequence (see the module
    docstring); the result is in the padded layout either way, 0 past each row's end.
    """
    n, width = input_ids.shape
    dev = input_ids.device  # the rank's device (learner/device.py): every index below is made there
    if not opts.pack:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logp = token_logprobs(logits, input_ids, opts.chunk_tokens, opts.temperature)
        where = ((torch.arange(n, device=dev) * width).unsqueeze(1)
                 + torch.arange(width - 1, device=dev).unsqueeze(0))  # flat row of (i, t)
    else:
        lengths = attention_mask.sum(dim=1)
        flat_ids = input_ids[attention_mask > 0].unsqueeze(0)  # row-major: the sequences end to end
        positions = torch.cat([torch.arange(int(k), device=dev) for k in lengths.tolist()]).unsqueeze(0)
        # no attention mask and no cache: transformers then reads the sequence boundaries off the position ids
        logits = model(input_ids=flat_ids, position_ids=positions, use_cache=False).logits
        cols = torch.arange(width - 1, device=dev).unsqueeze(0)
        valid = cols < (lengths - 1).unsqueeze(1)
        where = torch.where(valid, (torch.cumsum(lengths, 0) - lengths).unsqueeze(1) + cols, 0)
        logp = torch.where(valid, token_logprobs(logits, flat_ids, opts.chunk_tokens, opts.temperature)[0][where],
                           torch.zeros((), dtype=torch.float32, device=dev))
    ent = 0.0
    if entropy_mask is not None:
        ent = entropy_sum(logits.reshape(-1, logits.shape[-1]), where[entropy_mask > 0], opts.chunk_tokens,
                          opts.temperature)
    return logp, ent


def _rows(batch: Any, rows: list[int]) -> tuple[Tensor, int]:
    """Row indices and the micro-batch's own width (its longest row): padding beyond it is cut off."""
    idx = torch.tensor(rows, dtype=torch.long)
    return idx, int(batch.attention_mask[idx].sum(dim=1).max().item())


def in_step(plan: list[list[int]], agree: Callable[[int], int] | None) -> list[list[int]]:
    """``plan`` followed by empty entries up to ``agree(len(plan))`` (the largest count of any rank), so every
    rank runs as many forwards: under ZeRO-3 each forward gathers the parameters collectively, and a rank
    with fewer would leave the others waiting in a gather (a hang). ``agree=None``: ``plan`` as it is."""
    if agree is None:
        return plan
    return plan + [[] for _ in range(agree(len(plan)) - len(plan))]


@torch.no_grad()
def logprobs_no_grad(model: Any, batch: Any, rows: Tensor, opts: ForwardOptions,
                     agree: Callable[[int], int] | None = None) -> Tensor:
    """[len(rows), L-1] log-probs of ``rows`` without gradient, micro-batched like a training step.

    ``agree`` (a ZeRO-3 ``model`` on several ranks: ``ranks.max_over_ranks``) makes this rank run as many
    forwards as the rank with the most micro-batches (:func:`in_step`); an extra one forwards the shortest
    row and is thrown away.
    """
    out = torch.zeros(len(rows), batch.input_ids.shape[1] - 1, device=batch.input_ids.device)
    lengths = batch.attention_mask[rows].sum(dim=1).tolist()
    for part in in_step(plan_micro_batches(lengths, opts.max_tokens, opts.pack), agree):
        if not part:
            shortest = int(batch.attention_mask.sum(dim=1).argmin())
            idx, width = _rows(batch, [shortest])
            forward_logprobs(model, batch.input_ids[idx, :width], batch.attention_mask[idx, :width], opts)
            continue
        idx, width = _rows(batch, [int(rows[i]) for i in part])
        logp, _ = forward_logprobs(model, batch.input_ids[idx, :width], batch.attention_mask[idx, :width], opts)
        out[torch.tensor(part), :width - 1] = logp
    return out


def step_norm(mask: Tensor, max_tokens: int, world: int, all_reduce: Callable[[Tensor], None] | None) -> LossNorm:
    """The step's LossNorm from this rank's [B, T] mask, summed over ranks by ``all_reduce`` (in place)."""
    local = LossNorm.of(mask, max_tokens, world)
    counts = torch.tensor([local.tokens, local.seqs, local.rows], dtype=torch.float64)
    if all_reduce is not None:
        all_reduce(counts)
    tokens, seqs, rows = counts.tolist()
    return LossNorm(tokens, seqs, rows, max_tokens, world)


def engine_backward(engine: Any) -> Callable[[Tensor, bool], None]:
    """The ``backward(loss, last)`` of a DeepSpeed engine for :func:`accumulate_policy_grads`.

    ``last`` marks the accumulation boundary (``set_gradient_accumulation_boundary``): ZeRO-0/1 reduce across
    ranks only there, ZeRO-2/3 on every backward, and the caller's ``engine.step()`` then steps once. The loss
    is already divided by the step's counts, so DeepSpeed must not divide it by gradient_accumulation_steps
    (``scale_wrt_gas=False``; the config keeps that at 1 anyway).
    """

    def backward(loss: Tensor, last: bool) -> None:
        engine.set_gradient_accumulation_boundary(last)
        engine.backward(loss, scale_wrt_gas=False)

    return backward


@dataclass
class PolicyStep:
    """The per-token inputs of one optimizer step's policy loss, all [N, L-1] over the whole batch."""

    advantages: Tensor
    prox: Tensor | None
    """The proximal log-probs (None: the current ones, detached: one minibatch per step)."""
    current_version: float
    prox_version: int
    agreement: Any = None
    """An :class:`~async_rlhf.learner.agreement.Agreement` fed every micro-batch's log-probs (only when these
    forwards run at the step's starting weights: the first minibatch)."""


def accumulate_policy_grads(model: Any, batch: Any, plan: list[list[int]], step: PolicyStep, obj: Any,
                            norm: LossNorm, opts: ForwardOptions, backward: Callable[[Tensor, bool], None],
                            ref_model: Any = None) -> dict[str, float]:
    """Forward and backward every micro-batch of ``plan`` (row lists; ``[]`` is an empty one), never stepping.

    ``backward(loss, last)`` accumulates the gradient (``last`` is the accumulation boundary). Returns the
    step's metrics: token-weighted means over the micro-batches (max of ``/max``, min of ``/min``), the summed
    loss in ``optim/loss``, the KL to ``ref_model`` (when ``obj.kl_coef > 0``) and the mean token entropy.
    """
    parts: list[tuple[float, dict[str, float]]] = []
    last: dict[str, float] = {}
    loss_sum = kl_sum = entropy_total = 0.0
    for j, rows in enumerate(plan):
        idx, width = _rows(batch, rows or [0])
        ids, attn = batch.input_ids[idx, :width], batch.attention_mask[idx, :width]
        cols = slice(0, width - 1)
        mask = batch.loss_mask[idx, cols] if rows else torch.zeros(1, width - 1, device=ids.device)
        logp, ent = forward_logprobs(model, ids, attn, opts, entropy_mask=mask)
        prox = step.prox[idx, cols] if step.prox is not None else logp.detach()
        if step.agreement is not None and rows:
            step.agreement.observe(logp, batch.behav_logp[idx, cols], batch.versions[idx, cols], mask)
        loss, m = policy_loss(logp, prox, batch.behav_logp[idx, cols], step.advantages[idx, cols], mask, obj,
                              token_versions=batch.versions[idx, cols], current_version=step.current_version,
                              prox_version=step.prox_version, norm=norm)
        if ref_model is not None and obj.kl_coef > 0:
            with torch.no_grad():
                ref_logp, _ = forward_logprobs(ref_model, ids, attn, opts)
            kl = aggregate(kl_penalty(logp, ref_logp, mask, obj.kl_estimator), mask, "token_mean", norm)
            loss = loss + obj.kl_coef * kl
            kl_sum += float(kl.item())
        if not rows:
            loss = loss * 0.0  # an empty entry: the collectives of a backward, no gradient
        backward(loss, j == len(plan) - 1)
        tokens = float((mask > 0).sum().item())
        loss_sum += float(loss.item())
        entropy_total += ent
        if tokens > 0:
            parts.append((tokens, m))
        last = m
    if not parts:  # no trained token in the step: the (zero) metrics of the last forward
        parts = [(0.0, last)]
    merged: dict[str, float] = {}
    total = sum(w for w, _ in parts)
    for key in (parts[0][1] if parts else {}):
        values = [m[key] for _, m in parts]
        if key.endswith("/max"):
            merged[key] = max(values)
        elif key.endswith("/min"):
            merged[key] = min(values)
        else:
            merged[key] = sum(w * m[key] for w, m in parts) / total if total else values[-1]
    merged["optim/loss"] = loss_sum
    merged["ppo/entropy"] = entropy_total / total if total else 0.0
    if ref_model is not None and obj.kl_coef > 0:
        merged["ppo/kl_ref"] = kl_sum
    merged["perf/micro_batches"] = float(sum(1 for rows in plan if rows))
    return merged
