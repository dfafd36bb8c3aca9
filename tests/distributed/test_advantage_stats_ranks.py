"""Advantage statistics are the step's, not a rank's (issue 31, defect 5): REINFORCE++ normalises its advantages
by the mean and std of the whole step batch, and PPO whitens its GAE advantages over the whole step's tokens, so
two learner ranks with half the groups each must train on the advantages (and so the gradient) of one rank
with all of them. Real LearnerActor ranks (DeepSpeed ZeRO-2 over gloo; ``learner_ranks.py``), each collating
its own groups as its train loop does, then one ``_update``. Both scenarios run in one set of rank processes
kept for the module (one rank, and two), each building its own actors (``learner_ranks.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_ranks import LearnerRanks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks():
    """The rank processes kept for this module's scenarios."""
    kept = LearnerRanks(sizes=(1, 2))
    yield kept
    kept.close()


def _groups(vocab: int) -> list:
    """4 prompt groups x 3 completions; the first two groups' rewards spread far less than the last two's, so
    statistics over either half differ from those over all four."""
    from async_rlhf.types import Group, Sample

    rng = np.random.default_rng(3)
    rewards = [[0.1, 0.0, 0.2], [0.0, 0.3, 0.1], [2.0, -1.0, 0.5], [-2.0, 1.5, 3.0]]
    groups = []
    for gi, rs in enumerate(rewards):
        samples = [Sample(rng.integers(4, vocab, n).astype(np.int32), -rng.random(n).astype(np.float32),
                          np.zeros(n, np.int32), r) for n, r in zip((3, 5, 4), rs)]
        groups.append(Group(f"g{gi}", rng.integers(4, vocab, 3).astype(np.int32), samples))
    return groups


def _same_as_one_rank(ranks: LearnerRanks, model_dir: str, overrides: list[str]) -> None:
    groups = _groups(51)
    (one,) = ranks.run(model_dir, overrides, [{"groups": groups, "sizes": [3] * 4}])
    two = ranks.run(model_dir, overrides, [{"groups": groups[:2], "sizes": [3, 3]},
                                      {"groups": groups[2:], "sizes": [3, 3]}])
    want = torch.from_numpy(one["advantages"])
    got = [torch.from_numpy(r["advantages"]) for r in two]
    if want.dim() == 2:  # per token (PPO): each rank's batch is padded to its own longest row
        got = [g[:, :want.shape[1]] if g.shape[1] >= want.shape[1] else torch.nn.functional.pad(
            g, (0, want.shape[1] - g.shape[1])) for g in got]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-6)
    grads = {name: torch.from_numpy(g) for name, g in one["grads"][0].items()}
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4
    for rank in (0, 1):
        for name, g in two[rank]["grads"][0].items():
            torch.testing.assert_close(torch.from_numpy(g), grads[name], rtol=1e-4, atol=1e-7, msg=f"{rank} {name}")


def test_reinforce_pp_two_ranks_normalise_like_one(ranks, tiny_model_dir):
    _same_as_one_rank(ranks, str(tiny_model_dir), ["learner.zero_stage=2", "train.advantage=reinforce_pp"])


def test_ppo_two_ranks_whiten_like_one(ranks, tiny_model_dir):
    """reward_norm off: its running moments are kept per rank (a separate matter, left as it is)."""
    _same_as_one_rank(ranks, str(tiny_model_dir), ["learner.zero_stage=2", "train.algorithm=ppo",
                                                   "train.ppo.reward_norm=false",
                                                   "train.ppo.generator_reward_weight=1"])
