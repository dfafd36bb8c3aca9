"""PPO's running reward moments (``train.ppo.reward_norm``) are the step's, every rank's scores, not one rank's
(issue 44, item 12): two "ranks" with half the samples each (threads joined by an in-process sum,
``test_advantage_reduce.on_ranks``) normalise their scores, and so get the advantages, of one rank with all of
them, step after step; a checkpoint's moments load the same on every rank."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_advantage_reduce import on_ranks

from async_rlhf.config import load_config
from async_rlhf.learner.ppo import CRITIC_DIR, PPOTrainer, RunningMoments


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ZeroCritic:
    """The critic's no-grad values, all 0: the subject is the scores."""

    def values(self, input_ids, attention_mask, agree=None):
        return torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)


def _trainer() -> PPOTrainer:
    trainer = PPOTrainer.__new__(PPOTrainer)  # no critic engine, no reward model: the generator's reward scored
    trainer.cfg = load_config(None, ["train.algorithm=ppo", "train.ppo.generator_reward_weight=1",
                                     "train.ppo.reward_model_weight=0", "train.ppo.kl_coef=0"]).train.ppo
    assert trainer.cfg.reward_norm
    trainer.critic, trainer.reward_models, trainer.moments = ZeroCritic(), None, RunningMoments()
    trainer._sum_ranks = trainer._max_ranks = trainer._agree_no_grad = None
    return trainer


def _batch(rewards: list[float]) -> SimpleNamespace:
    n = len(rewards)
    mask = torch.zeros(n, 4)
    mask[:, 1:] = 1.0
    return SimpleNamespace(rewards=torch.tensor(rewards), input_ids=torch.ones(n, 5, dtype=torch.long),
                           attention_mask=torch.ones(n, 5, dtype=torch.long), loss_mask=mask,
                           behav_logp=torch.zeros(n, 4))


STEPS = [[0.1, 0.0, 0.2, 0.1, 5.0, -3.0, 4.0, 2.0], [0.3, 0.2, 0.0, 0.1, 1.0, 6.0, -2.0, 0.5]]
"""Two steps of 8 scores; rank 0 gets the first half (spread 0.1), rank 1 the second (spread ~3)."""


def test_reward_moments_of_two_halves_are_those_of_the_whole_step():
    whole, halves = _trainer(), [_trainer(), _trainer()]
    for scores in STEPS:
        want = whole.prepare(_batch(scores), None)
        got = on_ranks([lambda reduce, r=r: halves[r].prepare(_batch(scores[4 * r:4 * r + 4]), None, reduce)
                        for r in (0, 1)])
        torch.testing.assert_close(torch.cat([g.returns for g in got]), want.returns, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.cat([g.advantages for g in got]), want.advantages, rtol=1e-5, atol=1e-6)
    for rank in halves:
        assert rank.moments.state() == pytest.approx(whole.moments.state(), rel=1e-12)
    assert whole.moments.count == 16
    # each rank's own moments (the defect) normalise rank 0's small spread up to the other rank's large one
    alone = _trainer()
    for scores in STEPS:
        alone_returns = alone.prepare(_batch(scores[:4]), None).returns
    assert (alone_returns - want.returns[:4]).abs().max() > 0.5


def test_running_moments_update_with_a_reducer_and_a_rank_without_scores():
    x = torch.tensor([1e6 + 1.0, 1e6 + 2.0, 1e6 + 3.0, 1e6 + 4.0, 1e6 + 5.0])
    whole = RunningMoments()
    whole.update(x)
    parts = [RunningMoments(), RunningMoments()]
    on_ranks([lambda reduce: parts[0].update(x, reduce), lambda reduce: parts[1].update(x[:0], reduce)])
    for m in parts:
        assert (m.count, m.mean) == (5, pytest.approx(1e6 + 3.0)) and m.std == pytest.approx(2.0 ** 0.5, rel=1e-9)
    assert whole.state() == pytest.approx(parts[1].state(), rel=1e-12)


def test_checkpointed_moments_load_the_same_on_every_rank(tmp_path: Path):
    """Every rank saves the same (global) moments: any rank, of any count, loads them as they are. Files that
    differ (written when each rank kept its own) are merged on every rank, so the ranks agree from then on."""
    critic_dir = tmp_path / CRITIC_DIR
    critic_dir.mkdir()
    state = {"count": 16, "mean": 1.5, "m2": 40.0}
    for rank in (0, 1):
        (critic_dir / f"moments-rank{rank}.json").write_text(json.dumps(state))

    class LoadsNothing:
        def load_checkpoint(self, path, tag):
            return path, {}

    for rank in (0, 1, 2):
        trainer = _trainer()
        trainer.critic = SimpleNamespace(engine=LoadsNothing())
        assert trainer.load(tmp_path, rank)
        assert trainer.moments.state() == state
    (critic_dir / "moments-rank1.json").write_text(json.dumps({"count": 4, "mean": 0.5, "m2": 2.0}))
    loaded = []
    for rank in (0, 1):
        trainer = _trainer()
        trainer.critic = SimpleNamespace(engine=LoadsNothing())
        trainer.load(tmp_path, rank)
        loaded.append(trainer.moments.state())
    assert loaded[0] == loaded[1] and loaded[0]["count"] == 20
