"""PromptStream over a source that keeps its own positions (a Redis stream): continued, never replayed."""

from __future__ import annotations

from collections.abc import Iterable

from async_rlhf.generator.stream import PositionedSource, PromptStream


class Recorded:
    """Positions 1..len(drawn) already drawn (recorded), then new items from ``fresh`` (none: nothing ready)."""

    def __init__(self, drawn: list[str], fresh: list[str]) -> None:
        self.drawn, self.fresh = list(drawn), list(fresh)
        self.position, self.reads = 0, 0
        self._cursor, self._skip = len(drawn), set()  # as a stream read once: next() alone draws new entries

    def seek(self, start: int, skip: Iterable[int] = ()) -> None:
        self._cursor = self.position = start
        self._skip = set(skip)

    def recorded(self, positions: list[int]) -> list[str | None]:
        return [self.drawn[p - 1] if p <= len(self.drawn) else None for p in positions]

    def __next__(self) -> str:
        self._cursor += 1
        while self._cursor in self._skip:
            self._cursor += 1
        if self._cursor > len(self.drawn):
            if not self.fresh:
                raise StopIteration
            self.reads += 1
            self.drawn.append(self.fresh.pop(0))
        self.position = self._cursor
        return self.drawn[self._cursor - 1]


def test_a_positioned_source_is_continued_from_its_record_not_replayed() -> None:
    src = Recorded(["a", "b", "c", "d"], ["e", "f"])
    stream = PromptStream(src, start=2, reissue=[1], skip=[4])
    assert src.reads == 0  # nothing read to reach position 2
    assert isinstance(src, PositionedSource)
    assert [next(stream) for _ in range(4)] == [(1, "a"), (3, "c"), (5, "e"), (6, "f")]
    assert stream.position == 6 and src.reads == 2
