"""The prompt source named by ``prompts.source`` (one place to add sources)."""

from __future__ import annotations

from async_rlhf.config import Config
from async_rlhf.env.base import Environment
from async_rlhf.prompts.base import IterablePrompts, PromptSource


def make_prompts(cfg: Config, env: Environment, seed: int, consumer: str) -> PromptSource:
    p = cfg.prompts
    if p.source == "task":
        return IterablePrompts(env.train_prompts(seed))
    if p.source == "file":
        from async_rlhf.prompts.files import file_prompts

        return file_prompts(p.path, p.text_field, seed)
    if p.source == "python":
        from async_rlhf.rewards.base import load_callable

        return IterablePrompts(load_callable(p.path, "prompts.path")(), p.text_field)
    if p.source == "redis":
        from async_rlhf.prompts.redis_stream import RedisStreamPrompts

        return RedisStreamPrompts(p.redis_url, p.stream, consumer, p.text_field)
    raise ValueError(f"prompts.source={p.source!r} is not known; use task, file, python or redis")
