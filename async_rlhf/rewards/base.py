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
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from async_rlhf.env.base import Prompt

RewardFn = Callable[..., float]
"""fn(prompt_text, completion_text, prompt_data[, completion_ids=..., finish_reason=..., prompt_ids=...]) -> reward.
For a chat prompt, prompt_text is the rendered chat template and prompt_data["messages"] the messages."""

EXTRA_ARGS = ("completion_ids", "finish_reason", "prompt_ids")
"""Keyword arguments a reward function receives when its signature names them (or takes ``**kwargs``)."""


class Completion(str):
    """A completion's decoded text (special tokens such as eos and padding stripped) that also carries what the
    text cannot show: ``token_ids`` (every token after the prompt, eos included; in a multi-turn episode the
    observations too) and ``finish_reason`` (``stop``: an eos or stop token ended it; ``length``: it hit
    ``generator.max_new_tokens`` or the context) and ``prompt_ids`` (the tokens the model was given: a chat
    prompt after its template). Everywhere else it is a plain ``str``."""

    token_ids: list[int]
    finish_reason: str
    prompt_ids: list[int]

    def __new__(cls, text: str, token_ids: Sequence[int] = (), finish_reason: str = "stop",
                prompt_ids: Sequence[int] = ()) -> Completion:
        obj = super().__new__(cls, text)
        obj.token_ids = [int(t) for t in token_ids]
        obj.finish_reason = str(finish_reason)
        obj.prompt_ids = [int(t) for t in prompt_ids]
        return obj


def wanted_extras(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names of :data:`EXTRA_ARGS` that ``fn`` accepts (all of them with ``**kwargs``): older reward
    functions, ``fn(prompt, completion, data)``, are called exactly as before."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return EXTRA_ARGS
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)}
    return tuple(a for a in EXTRA_ARGS if a in names)


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
        self.extras = wanted_extras(fn)

    def _call(self, prompt: Prompt, completion: str) -> Any:
        if not self.extras:
            return self.fn(prompt.text, completion, dict(prompt.data))
        known = {"completion_ids": getattr(completion, "token_ids", None),
                 "finish_reason": getattr(completion, "finish_reason", None),
                 "prompt_ids": getattr(completion, "prompt_ids", None)}
        return self.fn(prompt.text, str(completion), dict(prompt.data), **{k: known[k] for k in self.extras})

    def score_now(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        values = [self._call(prompt, c) for c in completions]
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
