"""Chunked log-probs, step-wide loss normalisers, micro-batches and packed rows: the same gradient as one
padded batch, on the real tiny Qwen2 (plain torch backward; through DeepSpeed:
tests/distributed/test_learner_microbatch.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rlhf.config import ObjectiveConfig, choices
from async_rlhf.learner.batch import entropy_sum, token_logprobs
from async_rlhf.learner.microbatch import (
    ForwardOptions,
    PolicyStep,
    accumulate_policy_grads,
    forward_logprobs,
    logprobs_no_grad,
    plan_micro_batches,
    step_norm,
)
from async_rlhf.learner.objectives import LossNorm, entropy_from_logits, policy_loss

torch.set_num_threads(1)
AGGREGATIONS = choices("train.objective.aggregation")


# ----------------------------------------------------------------------------- chunked log-probs


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_chunked_logprobs_equal_full_log_softmax_values_and_gradient(chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 6, 11, generator=g) * 4).requires_grad_(True)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    weight = torch.randn(3, 5, generator=g)
    full = token_logprobs(logits, ids)
    (g_full,) = torch.autograd.grad((full * weight).sum(), logits)
    part = token_logprobs(logits, ids, chunk_tokens=chunk)
    (g_part,) = torch.autograd.grad((part * weight).sum(), logits)
    assert part.shape == full.shape == (3, 5) and part.dtype == torch.float32
    torch.testing.assert_close(part, full, rtol=0, atol=2e-6)
    torch.testing.assert_close(g_part, g_full, rtol=0, atol=2e-6)
    assert g_part[:, -1].abs().sum().item() == 0.0  # the last position predicts nothing


def test_chunked_logprobs_gradcheck_and_half_input():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 5, generator=g, dtype=torch.float64).requires_grad_(True)
    ids = torch.randint(0, 5, (2, 4), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids, chunk_tokens=3), (logits,))
    half = logits.detach().to(torch.bfloat16)
    out = token_logprobs(half, ids, chunk_tokens=2)
    assert out.dtype == torch.float32  # computed in fp32 from low-precision logits
    torch.testing.assert_close(out, token_logprobs(half, ids), rtol=0, atol=1e-6)


def test_chunked_entropy_equals_entropy_from_logits():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 9, generator=g) * 3
    logits[0, 1, 3:] = -float("inf")  # banned tokens: 0 log 0 = 0
    logits[1, 0] = float("nan")  # never read: not a trained position
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    want = entropy_from_logits(logits, mask).item() * mask.sum().item()
    positions = torch.nonzero(mask.reshape(-1) > 0).squeeze(1)
    for chunk in (0, 1, 4):
        assert entropy_sum(logits.reshape(10, 9), positions, chunk) == pytest.approx(want, abs=1e-5)


# ----------------------------------------------------------------------------- plans and normalisers


def test_plan_micro_batches_respects_the_budget():
    lengths = [5, 9, 3, 9, 2, 7]
    assert plan_micro_batches(lengths, 0, pack=False) == [[0, 1, 2, 3, 4, 5]]
    for pack in (False, True):
        plan = plan_micro_batches(lengths, 18, pack)
        assert sorted(i for part in plan for i in part) == list(range(6))
        for part in plan:
            cost = sum(lengths[i] for i in part) if pack else len(part) * max(lengths[i] for i in part)
            assert cost <= 18
    assert plan_micro_batches(lengths, 18, pack=False) == [[1, 3], [5, 0], [2, 4]]
    assert plan_micro_batches(lengths, 18, pack=True) == [[1, 3], [5, 0, 2, 4]]
    assert plan_micro_batches([30, 4], 10, pack=True) == [[0], [1]]  # too long for the budget: on its own


def test_dr_grpo_gradient_of_a_sample_does_not_depend_on_its_batch():
    """The same completion, beside short or long neighbours (padded width 4 or 9): the same gradient."""
    cfg = ObjectiveConfig(kind="decoupled_ppo", aggregation="seq_mean_token_sum_norm")
    mine = torch.tensor([-0.5, -1.0, -0.2])

    def grad_of_mine(other_len: int) -> torch.Tensor:
        width = max(3, other_len) + 1
        logp = torch.full((2, width), -0.7, dtype=torch.float64)
        logp[0, :3] = mine
        mask = torch.zeros(2, width, dtype=torch.float64)
        mask[0, :3], mask[1, :other_len] = 1, 1
        logp.requires_grad_(True)
        adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64).expand(2, width)
        loss, _ = policy_loss(logp, logp.detach(), logp.detach() - 0.1, adv, mask, cfg,
                              norm=LossNorm.of(mask, max_tokens=16))
        (grad,) = torch.autograd.grad(loss, logp)
        return grad[0, :3]

    short, long = grad_of_mine(2), grad_of_mine(8)
    torch.testing.assert_close(short, long, rtol=0, atol=0)
    assert short.abs().min().item() > 0
    # -A w / (B * T) per token: 1 * exp(0.1) / (2 * 16)
    assert short.tolist() == pytest.approx([-np.exp(0.1) / 32] * 3)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_ranks_with_step_counts_average_to_the_one_batch_gradient(aggregation):
    """Each rank divides by the all-reduced counts times the world size; DeepSpeed's average of the two
    gradients is then the gradient of both ranks' rows in one batch, even with unequal token counts."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])
    logp0 = -torch.rand(mask.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(5, 1, generator=g, dtype=torch.float64).expand(mask.shape)
    cfg = ObjectiveConfig(kind="decoupled_ppo", aggregation=aggregation)

    def grad(rows, norm):
        logp = logp0[rows].clone().requires_grad_(True)
        loss, _ = policy_loss(logp, logp.detach(), logp.detach() - 0.2, adv[rows], mask[rows], cfg, norm=norm)
        return torch.autograd.grad(loss, logp)[0]

    whole = grad(slice(None), LossNorm.of(mask, 6))
    ranks = [slice(0, 1), slice(1, 5)]
    other = {0: LossNorm.of(mask[ranks[1]], 6), 1: LossNorm.of(mask[ranks[0]], 6)}
    grads = []
    for r, rows in enumerate(ranks):
        def add_other(counts, r=r):
            counts += torch.tensor([other[r].tokens, other[r].seqs, other[r].rows], dtype=torch.float64)
        grads.append(grad(rows, step_norm(mask[rows], 6, world=2, all_reduce=add_other)))
    averaged = torch.cat(grads) / 2  # DeepSpeed averages; each rank holds only its own rows' gradient
    torch.testing.assert_close(averaged, whole, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # a reference that differs from the policy, so the KL term has a gradient
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ref.requires_grad_(False)
    return policy, ref


def _grads(policy, ref, batch, opts, aggregation, kl_coef=0.0):
    policy.zero_grad(set_to_none=True)
    rows = list(range(batch.input_ids.shape[0]))
    plan = [[rows[i] for i in part] for part in
            plan_micro_batches(batch.attention_mask.sum(1).tolist(), opts.max_tokens, opts.pack)]
    obj = ObjectiveConfig(kind="decoupled_ppo", aggregation=aggregation, kl_coef=kl_coef)
    adv = batch.advantages.unsqueeze(1).expand_as(batch.behav_logp)
    prox = logprobs_no_grad(policy, batch, torch.arange(len(rows)), ForwardOptions()) - 0.05
    m = accumulate_policy_grads(policy, batch, plan, PolicyStep(adv, prox, 0, 0), obj,
                                LossNorm.of(batch.loss_mask, max_tokens=12), opts,
                                lambda loss, last: loss.backward(), ref if kl_coef else None)
    return {n: p.grad.clone() for n, p in policy.named_parameters()}, m, len(plan)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batched_and_packed_gradients_equal_the_padded_single_batch(models, ragged_batch, aggregation):
    policy, ref = models
    batch = ragged_batch(policy.config.vocab_size)
    want, m0, n0 = _grads(policy, ref, batch, ForwardOptions(), aggregation, kl_coef=0.1)
    assert n0 == 1 and m0["ppo/kl_ref"] > 0
    for opts in (ForwardOptions(max_tokens=30), ForwardOptions(pack=True), ForwardOptions(pack=True, max_tokens=20),
                 ForwardOptions(pack=True, max_tokens=20, chunk_tokens=5), ForwardOptions(max_tokens=1)):
        got, m, n = _grads(policy, ref, batch, opts, aggregation, kl_coef=0.1)
        assert n > 1 or opts.max_tokens == 0
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=f"{opts} {name}")
        assert m["optim/loss"] == pytest.approx(m0["optim/loss"], rel=1e-5, abs=1e-7)
        assert m["ppo/kl_ref"] == pytest.approx(m0["ppo/kl_ref"], rel=1e-4)
        assert m["ppo/entropy"] == pytest.approx(m0["ppo/entropy"], rel=1e-5)
        assert m["is_weight/mean"] == pytest.approx(m0["is_weight/mean"], rel=1e-5)
    assert max(want[n].abs().max().item() for n in want) > 1e-4  # a real gradient, not zeros compared


def test_packed_forward_equals_padded_forward(models, ragged_batch):
    policy, _ = models
    batch = ragged_batch(policy.config.vocab_size, seed=1)
    inside = torch.arange(batch.input_ids.shape[1] - 1) < (batch.attention_mask.sum(1, keepdim=True) - 1)
    padded, ent_padded = forward_logprobs(policy, batch.input_ids, batch.attention_mask, ForwardOptions(), inside)
    packed, ent_packed = forward_logprobs(policy, batch.input_ids, batch.attention_mask,
                                          ForwardOptions(pack=True, chunk_tokens=4), inside)
    torch.testing.assert_close(packed[inside], padded[inside], rtol=0, atol=1e-5)
    assert ent_packed == pytest.approx(ent_padded, rel=1e-5) and ent_padded > 0
    assert packed[~inside].abs().sum().item() == 0.0
    # attention stays within each sequence: without the restart of positions the first rows would see others
    lengths = batch.attention_mask.sum(1)
    flat = batch.input_ids[batch.attention_mask > 0].unsqueeze(0)
    with torch.no_grad():
        leaky = token_logprobs(policy(input_ids=flat).logits, flat)[0]
    second = slice(int(lengths[0]), int(lengths[0] + lengths[1]) - 1)
    assert (leaky[second] - padded[1, : int(lengths[1]) - 1]).abs().max().item() > 1e-3


def test_micro_batches_run_in_a_smaller_forward(models, ragged_batch):
    """Under a small budget no forward sees more than the budget's tokens (or one sequence)."""
    policy, ref = models
    batch = ragged_batch(policy.config.vocab_size)
    seen = []
    def record(mod, args, kwargs):
        if torch.is_grad_enabled():  # the training forwards (not the no-grad one of the proximal log-probs)
            seen.append(kwargs["input_ids"].numel())

    hook = policy.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _grads(policy, ref, batch, ForwardOptions(pack=True, max_tokens=16), "token_mean")
    finally:
        hook.remove()
    longest = int(batch.attention_mask.sum(1).max())
    assert len(seen) > 1 and max(seen) <= max(16, longest) and sum(seen) == int(batch.attention_mask.sum())


def test_learner_switches_are_validated_at_load():
    from async_rlhf.config import ConfigError, load_config

    cfg = load_config(None, ["learner.max_tokens_per_micro_batch=4096", "learner.pack=true",
                             "learner.logprob_chunk_tokens=1024", "learner.gradient_checkpointing=true"])
    assert (cfg.learner.max_tokens_per_micro_batch, cfg.learner.pack, cfg.learner.logprob_chunk_tokens,
            cfg.learner.gradient_checkpointing) == (4096, True, 1024, True)
    defaults = load_config(None, []).learner
    assert (defaults.max_tokens_per_micro_batch, defaults.pack, defaults.logprob_chunk_tokens,
            defaults.gradient_checkpointing) == (0, False, 0, False)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch must be 0 or more"):
        load_config(None, ["learner.max_tokens_per_micro_batch=-1"])
    with pytest.raises(ConfigError, match="logprob_chunk_tokens must be 0 or more"):
        load_config(None, ["learner.logprob_chunk_tokens=-5"])
    with pytest.raises(ConfigError, match="online_dpo"):
        load_config(None, ["train.algorithm=online_dpo", "learner.pack=true"])


def test_gradient_checkpointing_keeps_the_packed_gradient(tiny_model_dir, ragged_batch):
    """learner.gradient_checkpointing (as the learner turns it on) recomputes the decoder layers in backward,
    packed position ids included, and changes no gradient."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    batch = ragged_batch(policy.config.vocab_size, seed=2)
    opts = ForwardOptions(pack=True, max_tokens=24)
    policy.train()
    calls: list[bool] = []
    hook = policy.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    try:
        want, _, micro = _grads(policy, None, batch, opts, "token_mean")
        plain = calls.count(True)
        calls.clear()
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        got, _, _ = _grads(policy, None, batch, opts, "token_mean")
    finally:
        hook.remove()
    assert micro > 1 and plain == micro and calls.count(True) == 2 * micro  # each layer ran again in backward
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-8, msg=name)
