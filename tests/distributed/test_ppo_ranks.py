"""PPO's critic, reward moments and online DPO over several real learner ranks (issue 44, defect 8 and item 12).

Two real LearnerActor ranks (DeepSpeed over gloo, ``learner_ranks.py``) with half the groups each must train as
one rank with all of them:

* PPO under ZeRO-3 and a padded token budget, one rank holding short rows and the other long ones, so their
  critics plan different numbers of micro-batches (every ZeRO-3 forward gathers the parameters: out of step
  they would hang), with ``reward_norm`` on and the halves' rewards spread differently: the advantages (reward
  moments and whitening over the whole step), the policy's gradient and the critic's gradient (its loss a
  mean over the step's tokens) equal one rank's;
* online DPO with two pairs on one rank and one on the other: the gradient is that of the mean over the three
  pairs, as one rank with all of them takes it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_ranks import LearnerRanks
from learner_ranks import rows_of as _rows

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks():
    """The rank processes kept for this module's scenarios."""
    kept = LearnerRanks(sizes=(1, 2))
    yield kept
    kept.close()


def _groups(vocab: int) -> list:
    """4 prompt groups x 3 completions: the first two short with rewards near 0, the last two long and spread
    wide, so each half's statistics (and micro-batch plans) differ from the whole's."""
    from async_rlhf.types import Group, Sample

    rng = np.random.default_rng(5)
    spec = [((1, 2, 1), [0.1, 0.0, 0.2]), ((2, 1, 2), [0.0, 0.3, 0.1]), ((9, 8, 7), [2.0, -1.0, 0.5]),
            ((7, 9, 8), [-2.0, 1.5, 3.0])]
    groups = []
    for gi, (lengths, rewards) in enumerate(spec):
        samples = [Sample(rng.integers(4, vocab, n).astype(np.int32), -rng.random(n).astype(np.float32),
                          np.zeros(n, np.int32), r) for n, r in zip(lengths, rewards)]
        groups.append(Group(f"g{gi}", rng.integers(4, vocab, 3).astype(np.int32), samples))
    return groups


def _fit(t: torch.Tensor, width: int) -> torch.Tensor:
    """A rank's per-token tensor at another width (each rank pads its batch to its own longest row)."""
    return t[:, :width] if t.shape[1] >= width else torch.nn.functional.pad(t, (0, width - t.shape[1]))


def _assert_same_grads(want: dict, got: list[dict], what: str) -> None:
    want = {name: torch.from_numpy(g) for name, g in want.items()}
    assert max(g.abs().max().item() for g in want.values()) > 1e-4, f"{what}: no gradient to compare"
    for rank, grads in enumerate(got):
        for name, g in grads.items():
            scale = want[name].abs().max().item()
            torch.testing.assert_close(torch.from_numpy(g), want[name], rtol=1e-4, atol=1e-6 * scale + 1e-8,
                                       msg=f"{what} rank {rank} {name}")


def test_ppo_zero3_budget_two_ranks_train_like_one(ranks, tiny_model_dir):
    from async_rlhf.learner.microbatch import plan_micro_batches

    groups = _groups(51)
    overrides = ["learner.zero_stage=3", "train.algorithm=ppo", "train.ppo.generator_reward_weight=1",
                 "train.ppo.reward_norm=true", "learner.max_tokens_per_micro_batch=24"]
    lengths = [[3 + len(s.completion_ids) for g in half for s in g.samples] for half in (groups[:2], groups[2:])]
    plans = [len(plan_micro_batches(half, 24, False)) for half in lengths]
    assert plans[0] < plans[1], plans  # the ranks' critics (and policies) run different numbers of forwards
    (one,) = ranks.run(str(tiny_model_dir), overrides, [{"groups": groups, "sizes": [3] * 4}])
    two = ranks.run(str(tiny_model_dir), overrides, [{"groups": groups[:2], "sizes": [3, 3]},
                                                     {"groups": groups[2:], "sizes": [3, 3]}])
    want = torch.from_numpy(one["advantages"])
    got = torch.cat([_fit(torch.from_numpy(r["advantages"]), want.shape[1]) for r in two])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert one["metrics"]["perf/critic_micro_batches"] > 1
    _assert_same_grads(one["grads"][0], [r["grads"][0] for r in two], "policy")
    assert len(one["critic_grads"]) == len(two[0]["critic_grads"]) == len(two[1]["critic_grads"]) == 1
    _assert_same_grads(one["critic_grads"][0], [r["critic_grads"][0] for r in two], "critic")


def test_online_dpo_two_ranks_with_unequal_pairs_train_like_one(ranks, tiny_model_dir, ragged_batch):
    batch = ragged_batch(51)  # 3 groups of 3, one pair each
    dpo = ["train.algorithm=online_dpo", "train.objective.kl_coef=0", "learner.zero_stage=2"]
    (one,) = ranks.run(str(tiny_model_dir), dpo, [{"batch": batch, "sizes": [3, 3, 3]}])
    two = ranks.run(str(tiny_model_dir), dpo, [{"batch": _rows(batch, list(range(6))), "sizes": [3, 3]},
                                               {"batch": _rows(batch, [6, 7, 8]), "sizes": [3]}])
    assert one["metrics"]["dpo/pairs"] == 3 and [r["metrics"]["dpo/pairs"] for r in two] == [2, 1]
    _assert_same_grads(one["grads"][0], [r["grads"][0] for r in two], "dpo")
