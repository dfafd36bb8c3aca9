"""PPO's reward mix (train.ppo.generator_reward_weight, train.ppo.reward_model_weight) and what it logs: the
task reward beside the reward models' score. A stand-in reward model (its scores fixed per row) is the only
fake; the subject is the mix."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from async_rlhf.config import ConfigError, load_config
from async_rlhf.learner.ppo import PPOTrainer, RunningMoments, reward_mix_metrics


class FixedScores:
    def __init__(self, scores: list[float]) -> None:
        self.values = torch.tensor(scores)

    def score(self, input_ids, attention_mask):
        return self.values.clone()


def _trainer(task_w: float, rm_w: float, rm_scores: list[float] | None) -> PPOTrainer:
    trainer = PPOTrainer.__new__(PPOTrainer)  # no critic: scores() never reads it
    trainer.cfg = SimpleNamespace(generator_reward_weight=task_w, reward_model_weight=rm_w)
    trainer.reward_models = FixedScores(rm_scores) if rm_scores is not None else None
    return trainer


BATCH = SimpleNamespace(rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), input_ids=None, attention_mask=None)


def test_default_weights_give_the_reward_models_score_only_and_log_the_task_reward():
    cfg = load_config(None, [])
    assert (cfg.train.ppo.generator_reward_weight, cfg.train.ppo.reward_model_weight) == (0.0, 1.0)
    scores, mix = _trainer(0.0, 1.0, [3.0, 5.0, 1.0, 7.0]).scores(BATCH)
    assert scores.tolist() == [3.0, 5.0, 1.0, 7.0]
    assert mix["rollout/task_reward_mean"] == 0.5 and mix["rollout/rm_score_mean"] == 4.0
    assert mix["ppo/rm_task_corr"] < -0.5  # the RM prefers the wrong answers here


def test_weights_mix_task_reward_and_reward_model_score():
    scores, mix = _trainer(2.0, 0.5, [3.0, 5.0, 1.0, 7.0]).scores(BATCH)
    assert scores.tolist() == [2 + 1.5, 2.5, 2 + 0.5, 3.5]
    # a reward model kept as a monitor only: its score is still logged
    scores, mix = _trainer(1.0, 0.0, [3.0, 5.0, 1.0, 7.0]).scores(BATCH)
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0] and mix["rollout/rm_score_mean"] == 4.0
    # no reward model: nothing to compare, no mix metrics
    scores, mix = _trainer(1.0, 1.0, None).scores(BATCH)
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0] and mix == {}


def test_reward_mix_metrics_correlation():
    t = torch.tensor([0.0, 1.0, 0.0, 1.0])
    m = reward_mix_metrics(t, 3 * t + 1)
    assert m["ppo/rm_task_corr"] == pytest.approx(1.0)
    assert m["ppo/task_reward_std"] == pytest.approx(0.5) and m["ppo/rm_score_std"] == pytest.approx(1.5)
    assert reward_mix_metrics(torch.ones(4), t)["ppo/rm_task_corr"] == 0.0  # a constant reward: no correlation


def test_running_moments_state_round_trip_and_merge():
    a, b, both = RunningMoments(), RunningMoments(), RunningMoments()
    a.update(torch.tensor([1.0, 2.0, 9.0]))
    b.update(torch.tensor([4.0, -3.0]))
    both.update(torch.tensor([1.0, 2.0, 9.0, 4.0, -3.0]))
    one = RunningMoments.merged([json.loads(json.dumps(a.state()))])
    assert (one.count, one.mean, one.m2) == (a.count, a.mean, a.m2)
    merged = RunningMoments.merged([a.state(), b.state()])
    assert merged.count == 5
    assert merged.mean == pytest.approx(both.mean) and merged.std == pytest.approx(both.std)
    assert math.isclose(RunningMoments.merged([]).std, 1.0)


def test_ppo_reward_config_refusals(tmp_path):
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="train.ppo.reward_model_weight must be 0 or more"):
        load_config(None, ["train.ppo.reward_model_weight=-1"])
    with pytest.raises(ConfigError, match="needs a reward"):  # the RM only watched, and no task weight
        load_config(None, ["train.algorithm=ppo", f"train.ppo.reward_models={rm}", "train.ppo.reward_model_weight=0"])
    cfg = load_config(None, ["train.algorithm=ppo", f"train.ppo.reward_models={rm}", "train.ppo.reward_model_weight=0",
                             "train.ppo.generator_reward_weight=1"])
    assert cfg.train.ppo.reward_model_weight == 0.0
