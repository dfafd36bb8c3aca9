"""The critic of PPO: a value head on a causal-LM body, the clipped value loss, and its own DeepSpeed engine.

Per-token tensors follow ``async_rlhf.learner.batch``: column t describes the token at position t+1, so the
value in column t is V(state after tokens 0..t), read from the hidden state at position t (the state in
which token t+1 is chosen)::

    input_ids   [ p0 p1 p2 c0 c1 c2 pad ]
    values         [ .  .  V2 V3 V4  .  ]    V2 = value of "p0 p1 p2", the state that produced c0

The critic trains beside the actor in the same learner rank (a second engine on the same process group),
so staleness control and batches are shared with the policy without any extra transport.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from async_rlhf.learner.objectives import masked_mean


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float) -> tuple[Tensor, dict[str, float]]:
    """0.5 * masked mean of the (clipped) squared error between values and returns; and metrics.

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
    loss = 0.5 * masked_mean(per_token, mask)
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


class CriticEngine:
    """The value model under its own DeepSpeed engine and optimizer, on the learner's process group."""

    def __init__(self, path: str, dtype_name: str, lr: float, clip: float, ds_config: dict[str, Any],
                 gradient_checkpointing: bool = False) -> None:
        import deepspeed

        dtype = getattr(torch, dtype_name)
        model = ValueModel(path, dtype)
        if gradient_checkpointing:  # the body's decoder layers recompute their activations in backward
            model.body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=dict(ds_config))
        self.clip = clip

    @torch.no_grad()
    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[N, L-1] values in the per-token column layout (see the module docstring); no gradient."""
        return self.engine(input_ids, attention_mask)[:, :-1].float()

    def update(self, input_ids: Tensor, attention_mask: Tensor, old_values: Tensor, returns: Tensor,
               mask: Tensor) -> dict[str, float]:
        """One optimizer step of the clipped value loss on these rows; returns its metrics."""
        self.engine.train()
        values = self.engine(input_ids, attention_mask)[:, :-1].float()
        loss, metrics = value_loss(values, old_values, returns, mask, self.clip)
        self.engine.backward(loss)
        self.engine.step()
        return metrics
