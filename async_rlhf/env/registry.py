"""Picks the task named in the configuration (one place to add environments)."""

from __future__ import annotations

from async_rlhf.config import TaskConfig
from async_rlhf.env.arithmetic import AdditionTask


def make_task(cfg: TaskConfig) -> AdditionTask:
    """The task with its canonical held-out split (the SFT warm start never trains on it either);
    runs vary only the order of training prompts, through ``train_problems(seed)``."""
    if cfg.name == "addition":
        return AdditionTask(digits=cfg.digits, heldout_size=cfg.heldout_size)
    raise ValueError(f"task.name={cfg.name!r} is not a known task; use addition")
