"""A resumable prompt stream: every prompt has a key (generator id, position in its stream).

The task's training stream is deterministic per generator, so a position is enough to continue it after a
restart or a resume, and a list of earlier positions is enough to re-issue prompts that were drawn but
never trained (in flight in a killed generator, or held in a memory buffer that died with the job).

    stream = PromptStream(task.train_problems(seed), start=120, reissue=[97, 101], skip={120})
    seq, problem = next(stream)   # 97, 101 first (replayed from the start), then 121, 122, ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

# the prompt key and group-id grammar lives below the packages that read it (async_rlhf/prompt_keys.py); named
# here as well for the modules that take it from the stream
from async_rlhf.prompt_keys import group_id as group_id
from async_rlhf.prompt_keys import key_of_group as key_of_group
from async_rlhf.prompt_keys import keys_of_group as keys_of_group
from async_rlhf.prompt_keys import prompt_key as prompt_key

P = TypeVar("P")


def client_name(gen_id: int) -> str:
    """Generator ``gen_id``'s name as a buffer client and prompt consumer: the buffer counts the admission slots
    it holds under it (the driver releases them by this name when the generator dies)."""
    return f"generator-{gen_id}"


@runtime_checkable
class PositionedSource(Protocol):
    """A source that keeps its own positions (a Redis stream, ``prompts/redis_stream.py``): it cannot be replayed,
    so a stream over it is continued with :meth:`seek` and re-issues with :meth:`recorded`; ``position`` is the
    position of the prompt its ``next()`` returned last."""

    position: int

    def seek(self, start: int, skip: Iterable[int] = ()) -> None: ...

    def recorded(self, positions: list[int]) -> list[Any]: ...


class PromptStream(Generic[P]):
    """Yields ``(seq, problem)``: first the re-issued positions, then ``start + 1, start + 2, ...``.

    ``start`` is the number of prompts already drawn (positions 1..start); ``skip`` holds later positions
    that must not be drawn again (already generated before a crash the driver noticed late). A deterministic
    stream is replayed up to ``start``; a :class:`PositionedSource` is never replayed: it continues after ``start``
    from its own record (positions it drew beyond ``start`` come back first) and gives re-issued prompts from it.
    """

    def __init__(self, problems: Iterator[P], start: int = 0, reissue: Iterable[int] = (),
                 skip: Iterable[int] = ()) -> None:
        if start < 0:
            raise ValueError(f"stream position must be 0 or more, got {start}")
        self._problems = problems
        wanted = sorted(set(int(s) for s in reissue))
        if wanted and (wanted[0] < 1 or wanted[-1] > start):
            raise ValueError(f"re-issued positions must lie in 1..{start}, got {wanted[0]}..{wanted[-1]}")
        self._skip = set(int(s) for s in skip)
        self._replayed: list[tuple[int, P]] = []
        self.position = 0
        self._positioned = isinstance(problems, PositionedSource)
        if self._positioned:  # e.g. a Redis stream: read once, never replayed (issue 44, defect 3)
            source: Any = problems
            source.seek(start, self._skip)
            self._replayed = [(seq, p) for seq, p in zip(wanted, source.recorded(wanted), strict=True)
                              if p is not None]
            self.position = start
            return
        for seq in range(1, start + 1):  # replay the deterministic stream up to the resume point
            problem = next(self._problems)
            if wanted and seq == wanted[0]:
                self._replayed.append((seq, problem))
                wanted.pop(0)
        self.position = start

    def __iter__(self) -> Iterator[tuple[int, P]]:
        return self

    def __next__(self) -> tuple[int, P]:
        if self._replayed:
            return self._replayed.pop(0)
        if self._positioned:  # the source numbers its prompts and passes over ``skip`` itself
            problem = next(self._problems)
            self.position = int(self._problems.position)  # type: ignore[attr-defined]
            return self.position, problem
        while True:
            self.position += 1
            problem = next(self._problems)
            if self.position not in self._skip:
                return self.position, problem

    @property
    def reissue_left(self) -> int:
        return len(self._replayed)

    @property
    def next_is_contiguous(self) -> bool:
        """Whether the next draw is position ``position + 1`` (not a re-issued prompt, not past a skipped one)."""
        return not self._replayed and self.position + 1 not in self._skip
