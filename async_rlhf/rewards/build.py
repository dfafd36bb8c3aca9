"""Reward sources from ``rewards.*`` (one place to add sources)."""

from __future__ import annotations

from collections.abc import Sequence

from async_rlhf.config import Config, parse_reward_sources
from async_rlhf.env.base import Environment, Prompt
from async_rlhf.rewards.base import FunctionReward, RewardSource, WeightedRewards, check_rewards, load_callable


def make_rewards(cfg: Config, env: Environment) -> RewardSource:
    """The weighted sum of the configured sources. ``model`` finds the reward-model Ray actors the driver started
    (``async_rlhf.rewards.model``)."""
    r = cfg.rewards
    parts: list[tuple[RewardSource, float]] = []
    for name, weight in parse_reward_sources(r.sources):
        if name == "task":
            if not env.has_verifier:
                raise ValueError(f"task.name={env.name} has no reward rule of its own; set rewards.sources")
            parts.append((TaskReward(env), weight))
        elif name == "function":
            parts.append((FunctionReward(load_callable(r.function, "rewards.function"), name=r.function,
                                         immediate=False), weight))
        elif name == "http":
            from async_rlhf.rewards.http import HttpScorer

            parts.append((HttpScorer(r.http_url, r.timeout_s), weight))
        elif name == "model":
            from async_rlhf.rewards.model import RewardModelSource, reward_model_actors

            parts.append((RewardModelSource(reward_model_actors(cfg)), weight))  # started by the driver
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][0]
    return WeightedRewards(parts)


class TaskReward(RewardSource):
    """The environment's own rule (``env.verify``), inline: a verifier is cheap."""

    name = "task"
    immediate = True

    def __init__(self, env: Environment) -> None:
        self.env = env

    def score_now(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        return check_rewards([self.env.verify(prompt, c) for c in completions], len(completions), "task")

    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        return self.score_now(prompt, completions)
