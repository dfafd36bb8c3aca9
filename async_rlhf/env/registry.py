"""Picks the task and the environment named in the configuration (one place to add environments)."""

from __future__ import annotations

from async_rlhf.config import TaskConfig
from async_rlhf.env.arithmetic import AdditionEnv, AdditionTask, RewardModelEnv
from async_rlhf.env.base import Environment, SingleTurnEnv
from async_rlhf.env.guess_number import GuessNumberEnv
from async_rlhf.env.longtail import LongTailEnv, LongTailTask


def make_task(cfg: TaskConfig) -> AdditionTask | LongTailTask:
    """The addition task with its canonical held-out split (the SFT warm start never trains on it either);
    runs vary only the order of training prompts, through ``train_problems(seed)``. The tiny policy's warm
    start and the launcher's held-out accuracy use it whatever the environment (longtail has its own)."""
    if cfg.name == "longtail":
        return LongTailTask(heldout_size=cfg.heldout_size)
    return AdditionTask(digits=cfg.digits, heldout_size=cfg.heldout_size)


def make_env(cfg: TaskConfig) -> Environment:
    """The environment ``task.name`` selects: addition | guess_number | reward_model | custom."""
    if cfg.name == "addition":
        return AdditionEnv(make_task(cfg))
    if cfg.name == "reward_model":
        return RewardModelEnv(make_task(cfg))
    if cfg.name == "longtail":
        return LongTailEnv(LongTailTask(heldout_size=cfg.heldout_size))
    if cfg.name == "guess_number":
        return GuessNumberEnv(max_turns=cfg.max_turns)
    if cfg.name == "agent":  # the agent's task (agent.task: addition); the generator wraps it in its AgentEnv
        return AdditionEnv(make_task(cfg))  # (async_rlhf.agent.build.serve_agents): prompts, held-out, its rule
    if cfg.name == "custom":
        env = SingleTurnEnv()
        env.name = "custom"
        return env
    raise ValueError(f"task.name={cfg.name!r} is not a known task; use addition, guess_number, reward_model, "
                     "longtail, agent or custom")
