"""The policy-gradient update of a learner rank (``train.algorithm`` grpo or ppo): ``train.minibatches`` optimizer
steps on one batch, each as micro-batches (``microbatch.py``), with PPO's critic trained once per minibatch.

A plain function of the rank's engine, models and collectives, apart from ``actor.py`` (which picks this or
``dpo_update.py`` and makes the step's agreement monitor) as online DPO's update is: the loop of one step reads
on its own, and the actor keeps the resources.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def policy_gradient_update(engine: Any, ref_model: Any, ppo: Any, cfg: Any, batch: Any, version: int,
                           world_size: int, phase: Callable[[str], Any], optimizer_step: Callable[[], None],
                           max_over_ranks: Callable[[int], int] | None, sum_over_ranks: Callable[[Any], None] | None,
                           agreement: Any) -> dict[str, float]:
    """``train.minibatches`` optimizer steps on one batch; returns metrics averaged over them (max of maxima).

    Advantages are group baselines (grpo) or GAE with the critic (``ppo``, a ``PPOTrainer``, which also trains
    the critic once per minibatch). The proximal policy is the weights at the start of the step (``version``):
    exactly the current weights (detached) with one minibatch, a no-grad forward with several, or interpolated
    by version for ``decoupled_ppo_interp``. ``phase`` times a state of the step (the actor's ``_phase``);
    ``max_over_ranks`` / ``sum_over_ranks``: the collectives over the data-parallel ranks (None with one rank);
    ``agreement`` (learner/agreement.py) sees the step's first forward at its starting weights.
    """
    import torch

    from async_rlhf.learner.microbatch import (
        ForwardOptions,
        PolicyStep,
        accumulate_policy_grads,
        engine_backward,
        in_step,
        logprobs_no_grad,
        plan_micro_batches,
        step_norm,
    )

    obj = cfg.train.objective
    lc = cfg.learner
    # log-probs of the distribution the generators sampled from: logits / generator.temperature
    opts = ForwardOptions(lc.pack, lc.logprob_chunk_tokens, lc.max_tokens_per_micro_batch, cfg.generator.temperature)
    n = batch.input_ids.shape[0]
    k = min(cfg.train.minibatches, n)
    every = torch.arange(n)
    prox_all = None
    # ZeRO-3 gathers the parameters in every forward: ranks agree on the count of no-grad forwards too
    agree = max_over_ranks if lc.zero_stage == 3 else None
    if k > 1 and obj.kind not in ("ppo", "decoupled_ppo_interp"):
        with phase("forward_backward"):
            prox_all = logprobs_no_grad(engine, batch, every, opts, agree)
        agreement.observe(prox_all, batch.behav_logp, batch.versions, batch.loss_mask)
    adv = batch.advantages.unsqueeze(1).expand_as(batch.behav_logp)
    targets = None
    if ppo is not None:
        ref = ref_model
        with phase("forward_backward"):
            targets = ppo.prepare(batch, (lambda: logprobs_no_grad(ref, batch, every, opts))
                                  if ref is not None else None,
                                  sum_over_ranks)
        adv = targets.advantages
    per_step: list[dict[str, float]] = []
    for j, idx in enumerate(every.chunk(k)):
        with phase("forward_backward"):
            norm = step_norm(batch.loss_mask[idx], cfg.generator.max_new_tokens, world_size, sum_over_ranks)
            parts = plan_micro_batches(batch.attention_mask[idx].sum(dim=1).tolist(), opts.max_tokens, opts.pack)
            # every rank runs as many forwards and backwards (ZeRO-2/3 reduce in each backward)
            plan = in_step([[int(idx[i]) for i in part] for part in parts], max_over_ranks)
            # the first minibatch's forwards run at the step's starting weights (unless prox_all did)
            step = PolicyStep(adv, prox_all, version + j / k, version,
                              agreement if j == 0 and prox_all is None else None)
            m = accumulate_policy_grads(engine, batch, plan, step, obj, norm, opts, engine_backward(engine),
                                        ref_model)
        optimizer_step()
        with phase("forward_backward"):
            if targets is not None:
                m.update(ppo.train_critic(batch, idx, targets))
        per_step.append(m)
    merged: dict[str, float] = {}
    for key in per_step[0]:
        values = [m[key] for m in per_step]
        merged[key] = max(values) if key.endswith("/max") else sum(values) / len(values)
    if targets is not None:
        merged.update(targets.metrics)
    return merged
