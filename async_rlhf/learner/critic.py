"""The critic of PPO: a value head on a causal-LM body, the clipped value loss, and its own DeepSpeed engine.

Per-token tensors follow ``async_rlhf.learner.batch``: column t describes the token at position t+1, so the
value in column t is V(state after tokens 0..t), read from the hidden state at position t (the state in
which token t+1 is chosen)::

    input_ids   [ p0 p1 p2 c0 c1 c2 pad ]
    values         [ .  .  V2 V3 V4  .  ]    V2 = value of "p0 p1 p2", the state that produced c0

The critic trains beside the actor in the same learner rank (a second engine on the same process group),
so staleness control and batches are shared with the policy without any extra transport.

Its forwards and backwards go through the policy's token budget (``learner.max_tokens_per_micro_batch``,
``learner/microbatch.py``), always padded (a padded micro-batch of rows x longest row never holds more than the
budget's tokens, packed or not)::

    values     no grad: each micro-batch forwarded, its [rows, width-1] values written into the [N, L-1] result
    update     each micro-batch: forward -> 0.5 * (sum of its tokens' squared errors) / (the step's tokens) ->
               backward (accumulates); one optimizer step after the last; the sum over the micro-batches is
               the loss of one forward of every row, so the gradient is the same

The step's tokens are summed over the learner ranks (``reduce``) and the loss multiplied by the ranks, which
DeepSpeed's average undoes: every token of the step weighs the same, on whichever rank it is. Every rank runs
as many forwards (and backwards) as the rank with the most (``agree``, :func:`microbatch.in_step`): ZeRO-2/3
reduce in every backward and ZeRO-3 gathers in every forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from async_rlhf.learner.microbatch import engine_backward, in_step, plan_micro_batches
from async_rlhf.learner.objectives import LossNorm, aggregate, masked_mean


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float, norm: LossNorm | None = None) -> tuple[Tensor, dict[str, float]]:
    """0.5 * masked mean of the (clipped) squared error between values and returns; and metrics.

    ``norm`` (a micro-batch of a step): the mean's denominator is the step's tokens (times its ranks, see
    :class:`~async_rlhf.learner.objectives.LossNorm`), not this tensor's; the metrics stay this tensor's.

    With ``clip > 0`` (PPO's value clipping): v_clip = old + clamp(v - old, -clip, clip) and the per-token
    error is max((v - R)^2, (v_clip - R)^2), so one update cannot move a value further than ``clip`` from
    the value it had when the targets were computed, for the part of the loss that would benefit from it.
    ``clip = 0`` is the plain squared error. Positions with mask 0 are never read.
    """
    valid = mask > 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(valid, values, zero)
    old = torch.where(valid, old_values.detach().to(v.dtype), zero)
    ret = torch.where(valid, returns.detach().to(v.dtype), zero)
    unclipped = (v - ret).square()
    if clip > 0:
        v_clipped = old + (v - old).clamp(-clip, clip)
        clipped = (v_clipped - ret).square()
        per_token = torch.maximum(unclipped, clipped)
        clip_active = valid & (clipped > unclipped)
    else:
        per_token = unclipped
        clip_active = torch.zeros_like(valid)
    loss = 0.5 * aggregate(per_token, mask, "token_mean", norm)
    with torch.no_grad():
        m = valid.to(torch.float64)
        ret64 = ret.to(torch.float64)
        resid = ret64 - v.detach().to(torch.float64)
        var_ret = masked_mean((ret64 - masked_mean(ret64, m)).square(), m)
        var_resid = masked_mean((resid - masked_mean(resid, m)).square(), m)
        explained = 1.0 - var_resid / var_ret if var_ret.item() > 0 else torch.zeros((), dtype=torch.float64)
        metrics = {
            "critic/value_loss": float(loss.item()),
            "critic/clip_frac": float(masked_mean(clip_active.to(torch.float64), m).item()),
            "critic/values_mean": float(masked_mean(v.detach().to(torch.float64), m).item()),
            "critic/returns_mean": float(masked_mean(ret64, m).item()),
            "critic/abs_error": float(masked_mean(resid.abs(), m).item()),
            "critic/explained_variance": float(explained),
        }
    return loss, metrics


class ValueModel(nn.Module):
    """A causal-LM body (its decoder, without the LM head) and a linear value head: [N, L] ids -> [N, L] values.

    The head starts at zero, so every initial value is 0 and the first advantages are the plain
    (KL-shaped) returns; the body starts from ``path`` (the policy itself unless ``--critic`` says otherwise).
    """

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(path, dtype=dtype)
        self.body.config.use_cache = False
        self.head = nn.Linear(self.body.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1)


Agree = Callable[[int], int]
"""The largest count of any learner rank (``ranks.max_over_ranks``): ranks run as many forwards."""


def _part(input_ids: Tensor, attention_mask: Tensor, rows: list[int]) -> tuple[Tensor, Tensor, Tensor, int]:
    """Row indices, ids and mask of ``rows``, cut to their own width (their longest row)."""
    idx = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
    width = int(attention_mask[idx].sum(dim=1).max().item())
    return idx, input_ids[idx, :width], attention_mask[idx, :width], width


def _shortest(attention_mask: Tensor) -> list[int]:
    """The row an empty entry of a plan forwards (it keeps a rank in step with the others, nothing more)."""
    return [int(attention_mask.sum(dim=1).argmin())]


@torch.no_grad()
def micro_batched_values(model: Any, input_ids: Tensor, attention_mask: Tensor, max_tokens: int,
                         agree: Agree | None = None) -> Tensor:
    """[N, L-1] values of right-padded rows, forwarded in micro-batches of at most ``max_tokens`` padded tokens
    (0: one forward); 0 past each micro-batch's width (never read: those columns are masked out)."""
    n, length = input_ids.shape
    out = torch.zeros(n, length - 1, dtype=torch.float32, device=input_ids.device)
    plan = plan_micro_batches(attention_mask.sum(dim=1).tolist(), max_tokens, pack=False)
    for rows in in_step(plan, agree):
        idx, ids, attn, width = _part(input_ids, attention_mask, rows or _shortest(attention_mask))
        values = model(ids, attn)[:, :-1].float()
        if rows:
            out[idx, :width - 1] = values
    return out


def accumulate_value_grads(model: Any, input_ids: Tensor, attention_mask: Tensor, old_values: Tensor,
                           returns: Tensor, mask: Tensor, clip: float, plan: list[list[int]], norm: LossNorm,
                           backward: Callable[[Tensor, bool], None]) -> tuple[Tensor, float]:
    """Forward and backward the clipped value loss of every micro-batch of ``plan`` (row lists; ``[]`` an empty
    entry, zero loss), never stepping: ``backward(loss, last)`` accumulates. Returns the [N, L-1] values the
    forwards gave (detached; the metrics are computed over them at once) and the summed loss."""
    values_all = torch.zeros_like(returns, dtype=torch.float32)
    total = 0.0
    for j, rows in enumerate(plan):
        idx, ids, attn, width = _part(input_ids, attention_mask, rows or _shortest(attention_mask))
        cols = slice(0, width - 1)
        values = model(ids, attn)[:, :-1].float()
        if rows:
            loss, _ = value_loss(values, old_values[idx, cols], returns[idx, cols], mask[idx, cols], clip, norm)
            values_all[idx, cols] = values.detach()
        else:
            loss = values.sum() * 0.0  # an empty entry: the collectives of a forward and backward, no gradient
        backward(loss, j == len(plan) - 1)
        total += float(loss.item())
    return values_all, total


class CriticEngine:
    """The value model under its own DeepSpeed engine and optimizer, on the learner's process group."""

    def __init__(self, path: str, dtype_name: str, lr: float, clip: float, ds_config: dict[str, Any],
                 gradient_checkpointing: bool = False, max_tokens: int = 0) -> None:
        import deepspeed

        dtype = getattr(torch, dtype_name)
        model = ValueModel(path, dtype)
        if gradient_checkpointing:  # the body's decoder layers recompute their activations in backward
            model.body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=dict(ds_config))
        self.clip = clip
        self.max_tokens = max_tokens
        """``learner.max_tokens_per_micro_batch``: the most padded tokens of one forward (0: all rows at once)."""

    def values(self, input_ids: Tensor, attention_mask: Tensor, agree: Agree | None = None) -> Tensor:
        """[N, L-1] values in the per-token column layout (see the module docstring); no gradient.

        ``agree`` (ZeRO-3 on several ranks, where every forward gathers): as many forwards as any rank."""
        return micro_batched_values(self.engine, input_ids, attention_mask, self.max_tokens, agree)

    def update(self, input_ids: Tensor, attention_mask: Tensor, old_values: Tensor, returns: Tensor,
               mask: Tensor, agree: Agree | None = None,
               reduce: Callable[[Tensor], None] | None = None) -> dict[str, float]:
        """One optimizer step of the clipped value loss on these rows, micro-batched under the token budget;
        returns its metrics (of all the rows, as one forward). ``reduce`` sums the step's token count over the
        ranks (the loss is the mean over every rank's tokens); ``agree``: as many forwards and backwards as
        the rank with the most."""
        self.engine.train()
        world = 1
        counts = torch.tensor([float((mask > 0).sum().item()), 1.0], dtype=torch.float64)
        if reduce is not None:
            reduce(counts)
            world = int(round(counts[1].item()))
        norm = LossNorm(float(counts[0].item()), 0.0, float(mask.shape[0]), 0, world)
        plan = in_step(plan_micro_batches(attention_mask.sum(dim=1).tolist(), self.max_tokens, pack=False), agree)
        values, _ = accumulate_value_grads(self.engine, input_ids, attention_mask, old_values, returns, mask,
                                           self.clip, plan, norm, engine_backward(self.engine))
        self.engine.step()
        _, metrics = value_loss(values, old_values, returns, mask, self.clip)
        metrics["perf/critic_micro_batches"] = float(sum(1 for rows in plan if rows))
        return metrics
