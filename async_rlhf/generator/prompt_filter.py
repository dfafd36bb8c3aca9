"""Skip prompts whose recent groups taught nothing, before generating them (pre-rollout filtering).

With dynamic sampling the buffer drops a prompt group whose rewards are all equal (``zero_advantage``), but only
after a generator spent a whole group of samples on it. On a prompt set where a solved prompt stays solved, its
next group is uniform again, and generating it is wasted. This filter keeps, per prompt, how many of its groups
in a row were uniform (``k``) and lets a drawn prompt through with probability ``max(min_retry, 2**-k)``::

    draw prompt p ──> k = uniform_streak[p] ──> random() < max(min_retry, 2**-k) ? ──yes──> generate a group
                                                        │ no                                    │ returns
                                                        └── skipped (counted), draw the next    v
                                                                                  all equal? k += 1 : k = 0

A prompt never seen, or whose last group was informative, is always generated; a solved (or hopeless) one is
still tried about ``min_retry`` of the times it comes up, so a prompt the policy forgets, or starts to learn,
is noticed and generated again at full rate.

Each generator keeps its own memory (what it generated itself): bounded, least recently updated first out. A
prompt is known by its rendered text, what the model sees (chat messages are rendered before the filter).
After GRESO (Zheng et al., 2025, "Act Only When It Pays"), which skips by the same kind of reward history.
Off by default (``prompts.skip_uninformative``): on our addition and longtail tasks a uniform group is chance
(samples right 97% of the time are all right in most groups of 8, whatever the prompt), and the share of
uniform groups stayed at 79-84% with the filter on (docs/benchmarks.md).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from async_rlhf.env.base import Prompt

DEFAULT_CAPACITY = 200_000
"""Prompts remembered per generator (a few dozen bytes each)."""


class UninformativePromptFilter:
    def __init__(self, min_retry: float, seed: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if not 0.0 < min_retry <= 1.0:
            raise ValueError(f"min_retry must be in (0, 1], got {min_retry}")
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.min_retry = min_retry
        self.capacity = capacity
        self._rng = random.Random(seed)
        self._streak: OrderedDict[str, int] = OrderedDict()
        self.skipped = 0
        """Prompts skipped so far."""

    def retry_probability(self, prompt: Prompt) -> float:
        """The chance that ``prompt`` is generated when drawn (1 unless its last groups were uniform)."""
        k = self._streak.get(prompt.text, 0)
        return 1.0 if k == 0 else max(self.min_retry, 0.5**k)

    def admit(self, prompt: Prompt) -> bool:
        """Whether to generate ``prompt`` now; a refusal is counted in :attr:`skipped`."""
        p = self.retry_probability(prompt)
        if p >= 1.0 or self._rng.random() < p:
            return True
        self.skipped += 1
        return False

    def observe(self, prompt: Prompt, returns: Sequence[float]) -> None:
        """The returns of one group of ``prompt``: all equal lengthens its streak, any difference resets it."""
        key = prompt.text
        uniform = len(returns) > 1 and len(set(returns)) == 1
        if not uniform:
            self._streak.pop(key, None)  # informative: always generated again (nothing to remember)
            return
        self._streak[key] = self._streak.pop(key, 0) + 1
        if len(self._streak) > self.capacity:
            self._streak.popitem(last=False)

    @property
    def remembered(self) -> int:
        """Prompts whose last group was uniform (an informative group makes the filter forget its prompt)."""
        return len(self._streak)
