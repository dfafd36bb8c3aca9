"""Forward passes the preference trainers and batch inference share: summed completion log-probs of a causal
LM, and scalar scores of a sequence-classification reward model."""

from __future__ import annotations

from typing import Any

import torch

from async_rlhf.learner.batch import token_logprobs
from async_rlhf.learner.losses import sequence_logp
from async_rlhf.offline.batching import pad_batch
from async_rlhf.offline.data import Encoded


def completion_logps(model: Any, examples: list[Encoded], pad_id: int) -> torch.Tensor:
    """log pi(completion + eos | prompt) of each example, [B]; differentiable unless called under no_grad."""
    batch = pad_batch(examples, pad_id)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return sequence_logp(token_logprobs(logits, batch.input_ids), batch.loss_mask)


def reward_scores(model: Any, examples: list[Encoded], pad_id: int) -> torch.Tensor:
    """The scalar score of each prompt + completion, [B].

    Right padding; the sequence-classification head reads the last non-pad token (transformers' rule), so the
    model's ``config.pad_token_id`` must be ``pad_id``.
    """
    batch = pad_batch(examples, pad_id)
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0].float()


def mismatched(examples: list[Encoded]) -> list[Encoded]:
    """Prompt i with the completion of example i+1 (cyclic): KTO's sample for its KL reference point."""
    n = len(examples)
    out = []
    for i, e in enumerate(examples):
        other = examples[(i + 1) % n]
        out.append(Encoded(ids=e.ids[:e.n_prompt] + other.ids[other.n_prompt:], n_prompt=e.n_prompt))
    return out
