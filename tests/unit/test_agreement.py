"""The training/inference agreement monitor (learner/agreement.py): which tokens count as same-version, the
figures over them, their reduction over learner ranks, and the feed from a micro-batched step."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from async_rlhf.learner.agreement import Agreement

pytestmark = pytest.mark.unit

V = 3  # the learner's version at the start of the step


def _rows():
    """4 rows x 4 columns: all v3 | spans a swap v2 -> v3 | all v2 | no trained token."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, -1.0, 0.0], [-3.0, -1.0, 0.0, 0.0], [0.0] * 4])
    behav = torch.tensor([[-1.1, -1.7, -0.5, 9.0], [-2.0, -1.0, -1.5, 9.0], [-1.0, -1.0, 0.0, 0.0], [5.0] * 4])
    versions = torch.tensor([[3, 3, 3, 0], [2, 3, 3, 0], [2, 2, 0, 0], [3, 3, 3, 3]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1.0, 1, 1, 0], [1.0, 1, 0, 0], [0.0] * 4])
    return logp, behav, versions, mask


def test_same_version_tokens_are_the_rows_wholly_at_the_learners_version() -> None:
    logp, behav, versions, mask = _rows()
    a = Agreement(V)
    a.observe(logp, behav, versions, mask)
    a.observe_sampled(behav, mask)
    m = a.metrics()
    # only row 0: row 1's v3 tokens were computed over KV that v2 wrote (an in-flight swap), row 2 is v2
    assert m["rollout/same_version_tokens"] == 3
    assert m["rollout/logp_mismatch_mean"] == pytest.approx((0.1 + 0.3 + 0.0) / 3)
    assert m["rollout/logp_mismatch_max"] == pytest.approx(0.3)
    diffs = [0.1, -0.3, 0.0, 1.0, 0.0, 0.5, -2.0, 0.0]  # learner - behaviour on every trained token
    assert m["rollout/is_ratio_mean"] == pytest.approx(sum(math.exp(d) for d in diffs) / 8)
    assert m["rollout/sampled_logp_mean"] == pytest.approx(float(behav[mask > 0].mean()))


def test_weights_that_are_no_pushed_version_have_no_same_version_tokens() -> None:
    logp, behav, versions, mask = _rows()
    a = Agreement(None)  # e.g. train.push_every=2, the step after a push's step
    a.observe(logp, behav, versions, mask)
    m = a.metrics()
    assert m["rollout/same_version_tokens"] == 0 and m["rollout/logp_mismatch_mean"] == 0.0
    assert m["rollout/logp_mismatch_max"] == 0.0 and m["rollout/is_ratio_mean"] > 0
    sampled_only = Agreement(V)  # online DPO: only the sampled tokens, no forward fed it
    sampled_only.observe_sampled(behav, mask)
    assert "rollout/is_ratio_mean" not in sampled_only.metrics()


def test_ranks_reduce_to_the_pooled_figures_token_weighted_and_max_of_max() -> None:
    logp, behav, versions, mask = _rows()
    pooled, ranks = Agreement(V), [Agreement(V), Agreement(V)]
    pooled.observe(logp, behav, versions, mask)
    pooled.observe_sampled(behav, mask)
    big = torch.tensor([[-1.0, -1.0, 0.0, 0.0]]), torch.tensor([[-3.0, -1.5, 0.0, 0.0]])
    pooled.observe(big[0], big[1], torch.full((1, 4), V), torch.tensor([[1.0, 1.0, 0, 0]]))
    ranks[0].observe(logp, behav, versions, mask)  # 3 same-version tokens, max 0.3
    ranks[0].observe_sampled(behav, mask)
    ranks[1].observe(big[0], big[1], torch.full((1, 4), V), torch.tensor([[1.0, 1.0, 0, 0]]))  # 2 tokens, max 2
    # what each rank puts into the two all-reduces (a reduce that leaves the tensors alone), then the
    # collectives' results handed to every rank's reduce
    local = []
    for r in ranks:
        out: list[torch.Tensor] = []
        copy.copy(r).reduce(out.append, out.append)
        local.append(out)
    total, top = local[0][0] + local[1][0], torch.maximum(local[0][1], local[1][1])
    for r in ranks:
        r.reduce(lambda t: t.copy_(total), lambda t: t.copy_(top))
    want = pooled.metrics()
    assert want["rollout/same_version_tokens"] == 5 and want["rollout/logp_mismatch_max"] == pytest.approx(2.0)
    for r in ranks:
        got = r.metrics()
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key]), key
    assert want["rollout/logp_mismatch_mean"] == pytest.approx((0.4 + 2.0 + 0.5) / 5)  # not the mean of means


def test_a_micro_batched_step_feeds_the_monitor_its_first_minibatchs_log_probs(tiny_model_dir, ragged_batch) -> None:
    from transformers import AutoModelForCausalLM

    from async_rlhf.config import ObjectiveConfig
    from async_rlhf.learner.microbatch import (
        ForwardOptions,
        PolicyStep,
        accumulate_policy_grads,
        logprobs_no_grad,
        plan_micro_batches,
    )
    from async_rlhf.learner.objectives import LossNorm

    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    batch = ragged_batch(policy.config.vocab_size)  # every token version 0
    n = batch.input_ids.shape[0]
    opts = ForwardOptions(max_tokens=24)
    plan = plan_micro_batches(batch.attention_mask.sum(1).tolist(), opts.max_tokens, opts.pack)
    assert len(plan) > 1
    whole = Agreement(0)
    whole.observe(logprobs_no_grad(policy, batch, torch.arange(n), ForwardOptions()), batch.behav_logp,
                  batch.versions, batch.loss_mask)
    fed = Agreement(0)
    adv = batch.advantages.unsqueeze(1).expand_as(batch.behav_logp)
    accumulate_policy_grads(policy, batch, plan + [[]], PolicyStep(adv, None, 0, 0, fed),
                            ObjectiveConfig(kind="ppo"), LossNorm.of(batch.loss_mask, max_tokens=12), opts,
                            lambda loss, last: loss.backward())
    assert fed.same_tokens == whole.same_tokens == float((batch.loss_mask > 0).sum())
    for key, value in whole.metrics().items():
        assert fed.metrics()[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def _rec(step: int, mean: float, top: float, same: int, tokens: int = 10, sampled: float = -1.0) -> dict:
    return {"step": step, "rollout/logp_mismatch_mean": mean, "rollout/logp_mismatch_max": top,
            "rollout/same_version_tokens": same, "rollout/tokens": tokens, "rollout/sampled_logp_mean": sampled}


def test_the_run_stops_on_a_mean_mismatch_above_run_max_logp_mismatch_naming_the_likely_causes() -> None:
    from async_rlhf.config import load_config
    from async_rlhf.driver.agreement import mismatch_failure

    bound = load_config().run.max_logp_mismatch
    assert 0 < bound <= 0.5  # on by default, far above fp32's ~1e-6 and bf16's ~1e-2
    assert mismatch_failure(_rec(3, 2e-6, 1e-5, 40), bound) is None
    assert mismatch_failure(_rec(3, 0.05, 3.0, 40), bound) is None  # one bad token of many: the mean decides
    assert mismatch_failure(_rec(3, 0.9, 3.0, 0), bound) is None  # nothing measured (no same-version token)
    assert mismatch_failure({"step": 3}, bound) is None  # online DPO: no monitor
    line = mismatch_failure(_rec(7, 0.4, 2.5, 40), bound)
    assert line is not None and "\n" not in line
    for words in ("step 7", "0.4", "2.5", "40", "run.max_logp_mismatch", "dtype", "prefix cache", "temperature",
                  "lm_head"):
        assert words in line, words
    assert mismatch_failure(_rec(7, 0.4, 2.5, 40), 0.0) is None  # 0: never
    assert load_config(None, ["run.max_logp_mismatch=0.5"]).run.max_logp_mismatch == 0.5


def test_the_progress_line_shows_the_mismatch_only_when_it_is_notable() -> None:
    from async_rlhf.driver.agreement import mismatch_note
    from async_rlhf.driver.runner import _progress_line

    base = {"step": 4, "version": 4, "rollout/reward_mean": 0.5, "staleness/mean": 0.0}
    quiet = _progress_line({**base, **_rec(4, 3e-6, 1e-5, 30)}, 10, "acc -", 100.0, 0, 5.0)
    loud = _progress_line({**base, **_rec(4, 2.1e-2, 0.3, 30)}, 10, "acc -", 100.0, 0, 5.0)
    assert "mismatch" not in quiet and "mismatch" not in _progress_line(base, 10, "acc -", 100.0, 0, 5.0)
    assert loud.endswith("| logp mismatch 2.1e-02 (max 3.0e-01)")
    assert mismatch_note(_rec(4, 0.5, 0.5, 0)) == ""


def test_summary_figures_are_token_weighted_over_the_run() -> None:
    from async_rlhf.driver.agreement import agreement_summary

    records = [_rec(1, 1e-6, 2e-6, 30, tokens=40, sampled=-1.0), _rec(2, 4e-6, 9e-6, 10, tokens=10, sampled=-2.0),
               _rec(3, 0.0, 0.0, 0, tokens=50, sampled=-0.5)]
    got = agreement_summary(records)
    assert got["same_version_tokens"] == 40
    assert got["logp_mismatch_mean"] == pytest.approx((30e-6 + 40e-6) / 40)
    assert got["logp_mismatch_max"] == pytest.approx(9e-6)
    assert got["sampled_logp_mean"] == pytest.approx((-40.0 - 20.0 - 25.0) / 100)
    none = agreement_summary([{"step": 1, "rollout/tokens": 5}])  # online DPO
    assert none == {"logp_mismatch_mean": None, "logp_mismatch_max": None, "same_version_tokens": 0,
                    "sampled_logp_mean": None}
