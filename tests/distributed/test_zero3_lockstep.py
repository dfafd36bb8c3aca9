"""ZeRO-3 ranks stay in step (issue 31, defect 4): under ``learner.zero_stage=3`` every forward gathers the
parameters collectively, so every learner rank must run as many forwards as the others, whatever its own rows.

Two real LearnerActor ranks (DeepSpeed ZeRO-3 over gloo, no Ray, no buffer) run one ``_update``:

* policy gradient with ``train.minibatches=2`` (a no-grad forward of the proximal log-probs, then two
  optimizer steps) under a packed token budget, one rank holding short rows and the other long ones, so they
  plan different numbers of micro-batches; the proximal log-probs and the first step's gradient must equal one
  rank holding all the rows;
* online DPO where one rank's groups are all ties (no pair): its chunk still forwards after the step; the
  gradient must equal the same two ranks under ZeRO-2 (no gathers there).

Out of step, ranks wait on each other's gathers: each rank reports when built, and the update itself gets
a bounded time to finish (``learner_ranks.py``), so the test fails instead of hanging. Every scenario of the
module runs in one set of rank processes (one rank, and two) kept for the module, each building its own actors.
"""

from __future__ import annotations

from dataclasses import replace

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


def test_zero3_ranks_with_different_micro_batch_counts_stay_in_step(ranks, tiny_model_dir, ragged_batch):
    """Short rows on rank 0, long ones on rank 1, under a packed budget of 20 tokens: rank 0 plans one
    micro-batch for its proximal log-probs and for each training step, rank 1 three and two."""
    from async_rlhf.learner.microbatch import plan_micro_batches

    batch = ragged_batch(51)
    lengths = batch.attention_mask.sum(1).tolist()
    short, long = [0, 7, 2, 8], [4, 1, 3, 6]  # 4, 3, 5, 7 tokens against 14, 9, 9, 9
    plans = [len(plan_micro_batches([lengths[i] for i in rows], 20, True)) for rows in (short, long)]
    assert plans == [1, 3]
    budget = ["learner.zero_stage=3", "train.minibatches=2", "learner.pack=true",
              "learner.max_tokens_per_micro_batch=20"]
    two = ranks.run(str(tiny_model_dir), budget, [{"batch": _rows(batch, short), "sizes": [4]},
                                                  {"batch": _rows(batch, long), "sizes": [4]}])
    # one rank with all of them, in the order that gives each minibatch the rows of both ranks' minibatches
    mixed = _rows(batch, short[:2] + long[:2] + short[2:] + long[2:])
    (one,) = ranks.run(str(tiny_model_dir), budget, [{"batch": mixed, "sizes": [8]}])
    assert len(one["prox"]) == len(two[0]["prox"]) == len(two[1]["prox"]) == 1
    whole = torch.from_numpy(one["prox"][0])
    for rank, at in ((0, [0, 1, 4, 5]), (1, [2, 3, 6, 7])):
        mine = torch.from_numpy(two[rank]["prox"][0])
        width = mine.shape[1]
        torch.testing.assert_close(mine, whole[at, :width], rtol=1e-5, atol=1e-6, msg=f"rank {rank} log-probs")
    assert len(one["grads"]) == len(two[0]["grads"]) == 2  # two optimizer steps
    want = {name: torch.from_numpy(g) for name, g in one["grads"][0].items()}
    assert max(g.abs().max().item() for g in want.values()) > 1e-4
    for rank in (0, 1):
        for name, g in two[rank]["grads"][0].items():
            torch.testing.assert_close(torch.from_numpy(g), want[name], rtol=1e-4, atol=1e-7, msg=f"{rank} {name}")


def test_zero3_online_dpo_rank_without_pairs_stays_in_step(ranks, tiny_model_dir, ragged_batch):
    """Rank 1's only group is a tie (no pair): it still takes part in every forward of rank 0's step."""
    batch = ragged_batch(51)
    batch = replace(batch, rewards=torch.tensor([1.0, 0, 0, 0, 1, 0, 0.5, 0.5, 0.5]))
    halves = [{"batch": _rows(batch, list(range(6))), "sizes": [3, 3]},
              {"batch": _rows(batch, [6, 7, 8]), "sizes": [3]}]
    dpo = ["train.algorithm=online_dpo", "train.objective.kl_coef=0"]
    three = ranks.run(str(tiny_model_dir), [*dpo, "learner.zero_stage=3"], halves)
    two = ranks.run(str(tiny_model_dir), [*dpo, "learner.zero_stage=2"], halves)
    assert three[0]["metrics"]["dpo/pairs"] == 2 and three[1]["metrics"]["dpo/pairs"] == 0
    assert "dpo/margin_after_step" in three[0]["metrics"]
    assert max(abs(g).max() for g in two[0]["grads"][0].values()) > 1e-4
    for rank in (0, 1):
        for name, g in three[rank]["grads"][0].items():
            torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(two[0]["grads"][0][name]), rtol=1e-4,
                                       atol=1e-7, msg=f"{rank} {name}")
