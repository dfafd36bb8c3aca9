"""The prompt-source interface: an iterator that never blocks the generator loop.

A source that has nothing right now (a Redis stream nobody has written to yet) prefetches fewer or none;
the generator asks again at its next admission and keeps its engine stepping meanwhile.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from async_rlhf.env.base import Prompt
from async_rlhf.prompts.chat import is_messages, to_messages


def to_prompt(item: Any, text_field: str = "prompt") -> Prompt:
    """A Prompt from a string, a list of chat messages, a Prompt, or a mapping whose ``text_field`` holds a
    string or chat messages (other fields become data). Chat prompts are rendered later, by the generator
    (``async_rlhf.prompts.chat``)."""
    if isinstance(item, Prompt):
        return item
    if isinstance(item, str):
        return Prompt(item)
    if isinstance(item, (list, tuple)):
        return Prompt("", {}, to_messages(item))
    if isinstance(item, Mapping):
        value = item.get(text_field)
        data = {k: v for k, v in item.items() if k != text_field}
        if isinstance(value, str):
            return Prompt(value, data)
        if is_messages(value):
            return Prompt("", data, to_messages(value, f"prompt record field {text_field!r}"))
        raise ValueError(f"prompt record {dict(item)!r:.120} has no text field {text_field!r} (a string or a list "
                         "of chat messages); set prompts.text_field to the field holding the prompt")
    raise ValueError(f"cannot make a prompt of {type(item).__name__}: give str, chat messages, dict or Prompt")


class PromptSource(ABC):
    """An iterator of prompts that can say, without blocking, how many it has ready.

    The generator asks ``prefetch(n)`` before it asks the buffer to admit that many groups, then draws them
    with ``next()``; prompts fetched but not yet drawn stay here for the next admission.
    """

    def __init__(self) -> None:
        self._ready: deque[Prompt] = deque()

    @abstractmethod
    def _fetch(self, n: int) -> list[Prompt]:
        """Up to ``n`` more prompts available now (never blocks)."""

    def prefetch(self, n: int) -> int:
        """How many prompts (at most ``n``) can be drawn right now."""
        if len(self._ready) < n:
            self._ready.extend(self._fetch(n - len(self._ready)))
        return min(n, len(self._ready))

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        if not self._ready and not self.prefetch(1):
            raise StopIteration
        return self._ready.popleft()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class IterablePrompts(PromptSource):
    """Any Python iterable of str, dict or Prompt (a dataset is cycled by its own iterator)."""

    def __init__(self, items: Iterable[Any], text_field: str = "prompt") -> None:
        super().__init__()
        self._items: Iterator[Any] = iter(items)
        self.text_field = text_field

    def _fetch(self, n: int) -> list[Prompt]:
        return [to_prompt(item, self.text_field) for item in itertools.islice(self._items, n)]
