"""Picks the task named in the configuration (one place to add environments)."""

from __future__ import annotations

from async_rlhf.config import TaskConfig
from async_rlhf.env.arithmetic import AdditionTask


def make_task(cfg: TaskConfig, seed: int = 0) -> AdditionTask:
    if cfg.name == "addition":
        return AdditionTask(digits=cfg.digits, heldout_size=cfg.heldout_size, seed=seed)
    raise ValueError(f"task.name={cfg.name!r} is not a known task; use addition")
