"""The prompt source named by ``prompts.source`` (one place to add sources)."""

from __future__ import annotations

from async_rlhf.config import Config
from async_rlhf.env.base import Environment
from async_rlhf.prompts.base import IterablePrompts, PromptSource


def make_prompts(cfg: Config, env: Environment, seed: int, consumer: str,
                 lane: tuple[int, int] | None = None) -> PromptSource:
    """The source of one generator. ``lane=(i, n)``: generator ``i`` of a fleet of ``n`` partitions a file or
    Python source with the others (disjoint strides of one sequence seeded by ``train.seed``: each prompt once
    per epoch across the fleet); None draws on its own with ``seed``. The task's own stream is drawn at random
    per generator (``seed``) and a Redis stream gives each prompt to one consumer anyway."""
    p = cfg.prompts
    if p.source == "task":
        return IterablePrompts(env.train_prompts(seed))
    if p.source == "file":
        from async_rlhf.prompts.files import file_prompts

        if lane is None:
            return file_prompts(p.path, p.text_field, seed)
        return file_prompts(p.path, p.text_field, cfg.train.seed, *lane)
    if p.source == "python":
        import itertools

        from async_rlhf.rewards.base import load_callable

        items = load_callable(p.path, "prompts.path")()
        if lane is not None:
            items = itertools.islice(items, lane[0], None, lane[1])
        return IterablePrompts(items, p.text_field)
    if p.source == "redis":
        from async_rlhf.prompts.redis_stream import RedisStreamPrompts

        # positions recorded per run (run.id): a fresh run on the same stream never re-issues an earlier run's
        return RedisStreamPrompts(p.redis_url, p.stream, consumer, p.text_field, scope=cfg.run.id)
    raise ValueError(f"prompts.source={p.source!r} is not known; use task, file, python or redis")
