"""Micro-batches through a real one-rank DeepSpeed engine (ZeRO-0 and ZeRO-2, fp32): the accumulated gradient of
a token-budgeted, packed step equals the gradient of the same rows in one padded forward, read with DeepSpeed's
``safe_get_full_grad`` before the step; and one ``engine.step()`` after the micro-batches is one optimizer step."""

from __future__ import annotations

import pytest
import torch
from learner_ranks import LearnerRanks, rows_of

from async_rlhf.config import ObjectiveConfig
from async_rlhf.learner.microbatch import (
    ForwardOptions,
    PolicyStep,
    accumulate_policy_grads,
    engine_backward,
    logprobs_no_grad,
    plan_micro_batches,
)
from async_rlhf.learner.objectives import LossNorm

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("module_process_group")]


def _engine(model_dir, zero_stage: int):
    from transformers import AutoModelForCausalLM

    from async_rlhf.learner.engine import build_engine

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.use_cache = False
    return build_engine(model, lr=1e-3, micro_batch=1, zero_stage=zero_stage)


def _step_grads(engine, batch, opts: ForwardOptions):
    from deepspeed.utils import safe_get_full_grad

    n = batch.input_ids.shape[0]
    plan = plan_micro_batches(batch.attention_mask.sum(1).tolist(), opts.max_tokens, opts.pack)
    prox = logprobs_no_grad(engine, batch, torch.arange(n), ForwardOptions()) - 0.05
    adv = batch.advantages.unsqueeze(1).expand_as(batch.behav_logp)
    obj = ObjectiveConfig(kind="decoupled_ppo", aggregation="seq_mean_token_sum_norm")
    m = accumulate_policy_grads(engine, batch, plan, PolicyStep(adv, prox, 0, 0), obj,
                                LossNorm.of(batch.loss_mask, max_tokens=12), opts, engine_backward(engine))
    grads = {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    engine.step()
    return grads, m, len(plan)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_deepspeed_micro_batches_accumulate_the_one_batch_gradient(tiny_model_dir, ragged_batch, zero_stage):
    torch.set_num_threads(1)
    whole = _engine(tiny_model_dir, zero_stage)
    batch = ragged_batch(whole.module.config.vocab_size)
    want, m0, n0 = _step_grads(whole, batch, ForwardOptions())
    parts = _engine(tiny_model_dir, zero_stage)
    got, m, n = _step_grads(parts, batch, ForwardOptions(pack=True, max_tokens=20, chunk_tokens=8))
    assert n0 == 1 and n > 2
    assert max(g.abs().max().item() for g in want.values()) > 1e-4
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)
    assert m["optim/loss"] == pytest.approx(m0["optim/loss"], rel=1e-5)
    assert whole.global_steps == parts.global_steps == 1  # one optimizer step each, whatever the micro-batches
    # and the same first AdamW update (~ lr * sign(g)) where the gradient is well above the rounding noise
    for (name, a), b in zip(whole.module.named_parameters(), parts.module.parameters()):
        clear = want[name].abs() > 1e-5
        torch.testing.assert_close(b.detach()[clear], a.detach()[clear], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def ranks():
    """The rank processes (one rank, and two) of the LearnerActor scenario, started together."""
    kept = LearnerRanks(sizes=(1, 2))
    yield kept
    kept.close()


def test_two_learner_ranks_micro_batched_and_packed_give_the_one_rank_gradient(ranks, tiny_model_dir, ragged_batch):
    """LearnerActor._update on two ZeRO-2 ranks, each with its own rows (unequal token counts and micro-batch
    counts), packed under a token budget, against one rank with all rows in one padded forward."""
    batch = ragged_batch(51)
    lengths = batch.attention_mask.sum(1).tolist()
    assert len(lengths) == 9
    model_dir = str(tiny_model_dir)
    (one,) = ranks.run(model_dir, ["learner.zero_stage=2"], [{"batch": batch}])
    halves = [rows_of(batch, [0, 2, 7]), rows_of(batch, [1, 3, 4, 5, 6, 8])]  # 11 against 49 trained tokens
    two = ranks.run(model_dir, ["learner.zero_stage=2", "learner.pack=true", "learner.max_tokens_per_micro_batch=20",
                                "learner.logprob_chunk_tokens=8"], [{"batch": b} for b in halves])
    assert two[0]["metrics"]["perf/micro_batches"] < two[1]["metrics"]["perf/micro_batches"]
    # the gradient read before the last (here the only) optimizer step of each rank
    want, *got = ({n: torch.from_numpy(g) for n, g in r["grads"][-1].items()} for r in (one, *two))
    assert max(g.abs().max().item() for g in want.values()) > 1e-4
    for name in want:
        torch.testing.assert_close(got[0][name], want[name], rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(got[1][name], want[name], rtol=1e-4, atol=1e-7, msg=name)

