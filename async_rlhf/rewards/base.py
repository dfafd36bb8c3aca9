"""The reward-source interface and the two in-process sources (a Python function, a weighted sum).

A source scores one prompt group: ``await source.score(prompt, completions) -> one float per completion``.
Sources that are cheap and local say ``immediate = True``: the generator then calls ``score_now`` inline and
puts the group with its rewards. Any other source is awaited while the engine keeps stepping, and its
rewards reach the buffer after the trajectories (late rewards).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from async_rlhf.env.base import Prompt

RewardFn = Callable[[str, str, dict[str, Any]], float]
"""fn(prompt_text, completion_text, prompt_data) -> reward."""


class RewardError(RuntimeError):
    """A source gave no usable rewards (wrong count, not numbers, nan); the message says which and why."""


def check_rewards(values: Any, n: int, who: str) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise RewardError(f"{who} returned {values!r:.80}, expected a list of {n} numbers (one per completion)")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"{who} returned {v!r} among its rewards; every reward must be a finite number")
        out.append(float(v))
    return out


class RewardSource(ABC):
    name: str = "reward"
    immediate: bool = False

    @abstractmethod
    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        """One reward per completion of ``prompt``."""

    def score_now(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        raise NotImplementedError(f"{self.name} is not immediate; await score() instead")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads or connections."""


_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="reward")
"""Threads for blocking scorers (a slow Python function, HTTP calls): the engine loop never waits on them."""


def run_blocking(fn: Callable[[], Any]) -> asyncio.Future[Any]:
    return asyncio.get_running_loop().run_in_executor(_POOL, fn)


class FunctionReward(RewardSource):
    """A plain Python function; ``immediate`` runs it inline (cheap verifiers), otherwise on a thread."""

    def __init__(self, fn: RewardFn, *, name: str = "function", immediate: bool = True) -> None:
        self.fn = fn
        self.name = name
        self.immediate = immediate

    def score_now(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        values = [self.fn(prompt.text, c, dict(prompt.data)) for c in completions]
        return check_rewards(values, len(completions), self.name)

    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        if self.immediate:
            return self.score_now(prompt, completions)
        return await run_blocking(lambda: self.score_now(prompt, completions))


class WeightedRewards(RewardSource):
    """sum_k weight_k * source_k; immediate only when every source is. Sources run concurrently."""

    def __init__(self, parts: Sequence[tuple[RewardSource, float]]) -> None:
        if not parts:
            raise ValueError("WeightedRewards needs at least one source")
        self.parts = list(parts)
        self.name = "+".join(f"{w:g}*{s.name}" for s, w in self.parts)
        self.immediate = all(s.immediate for s, _ in self.parts)

    def _combine(self, scores: Sequence[list[float]], n: int) -> list[float]:
        return [sum(w * s[i] for (_, w), s in zip(self.parts, scores)) for i in range(n)]

    def score_now(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        return self._combine([s.score_now(prompt, completions) for s, _ in self.parts], len(completions))

    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        scores = await asyncio.gather(*(s.score(prompt, completions) for s, _ in self.parts))
        return self._combine(scores, len(completions))

    def close(self) -> None:
        for s, _ in self.parts:
            s.close()


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """``module:name`` or ``/path/to/file.py:name`` -> the object; ValueError naming what is wrong."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{what}={spec!r} must look like module:function or /path/file.py:function")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{what}={spec!r}: no such file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"async_rlhf_user_{path.stem}", path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"{what}={spec!r}: cannot import {target} ({exc}); put it on PYTHONPATH or give "
                             "the file path") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what}={spec!r}: {target} has no function {attr}")
    return fn
