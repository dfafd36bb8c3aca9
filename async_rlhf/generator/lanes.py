"""How a file or Python prompt source is dealt to the generators, and how a resume on another fleet size deals
what is left (pure; issue 44, defect 7).

The source is one sequence of prompts (a file: its records reshuffled every epoch, ``prompts.files.epochs``);
a prompt's *global index* is its place in it. A :class:`Layout` deals the global indices to ``lanes`` generators:
the indices still to deal form the ascending sequence ``V`` (some ranges, then every index from ``tail`` on),
and generator ``j``'s stream positions after ``base[j]`` are ``V[j], V[j + lanes], V[j + 2 * lanes], ...``::

    fresh run of 2 generators:  V = 0, 1, 2, ...   generator 0 -> 0, 2, 4 ...   generator 1 -> 1, 3, 5 ...
                                (exactly the strides of ``epochs(lane, lanes)``)

A resume with another fleet size (:func:`relayout`) keeps every key it has (a stream position never changes its
meaning: the new positions start after the old ones, ``base``) and deals again what no old lane will issue: the
open positions (drawn, not trained, not held by a durable buffer, which trains them under their keys) and the
indices of ``V`` a slower lane never reached, followed by the rest of ``V``. So each global index is issued once
across the old and the new fleet: every record of an epoch trained exactly once, whatever the fleet sizes.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from async_rlhf.generator.stream import PromptStream


@dataclass
class Layout:
    lanes: int
    """The fleet size the positions after ``base`` are strides of."""
    base: dict[int, int] = field(default_factory=dict)
    """Per generator, the last position of an earlier layout (0: none); positions up to it are never re-issued."""
    ranges: list[tuple[int, int]] = field(default_factory=list)
    """The first indices of ``V``: ascending half-open ranges of global indices, all below ``tail``."""
    tail: int = 0
    """``V`` goes on with every global index from here."""

    @classmethod
    def default(cls, lanes: int) -> Layout:
        return cls(int(lanes))

    def is_default(self) -> bool:
        return not self.ranges and self.tail == 0 and not any(self.base.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON (checkpoint manifests, the generators' ``resume_stream``)."""
        return {"lanes": self.lanes, "base": {str(g): b for g, b in sorted(self.base.items()) if b},
                "ranges": [[a, b] for a, b in self.ranges], "tail": self.tail}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        return cls(int(data["lanes"]), {int(g): int(b) for g, b in dict(data.get("base") or {}).items()},
                   [(int(a), int(b)) for a, b in data.get("ranges") or []], int(data.get("tail", 0)))

    def _starts(self) -> list[int]:
        """Index in ``V`` of each range's first element, then of ``tail``."""
        out, n = [], 0
        for a, b in self.ranges:
            out.append(n)
            n += b - a
        return [*out, n]

    def at(self, v: int) -> int:
        """``V[v]``: the global index at place ``v`` of what is dealt."""
        starts = self._starts()
        if v >= starts[-1]:
            return self.tail + v - starts[-1]
        i = bisect.bisect_right(starts, v) - 1
        return self.ranges[i][0] + v - starts[i]

    def lane_globals(self, lane: int) -> Iterator[int]:
        """The global indices of ``lane``'s positions ``base + 1, base + 2, ...`` (ascending, endless)."""
        starts = self._starts()
        v = lane
        while v < starts[-1]:
            i = bisect.bisect_right(starts, v) - 1
            yield self.ranges[i][0] + v - starts[i]
            v += self.lanes
        while True:
            yield self.tail + v - starts[-1]
            v += self.lanes

    def suffix(self, k: int) -> tuple[list[tuple[int, int]], int]:
        """``V[k:]`` as (ranges, tail)."""
        ranges: list[tuple[int, int]] = []
        skip = k
        for a, b in self.ranges:
            if skip >= b - a:
                skip -= b - a
                continue
            ranges.append((a + skip, b))
            skip = 0
        return ranges, self.tail + skip


@dataclass
class Relaid:
    """What :func:`relayout` decided."""

    layout: Layout
    positions: dict[int, int]
    outstanding: dict[int, set[int]]
    moved: int
    """Open positions of the old lanes dealt again under new keys."""
    abandoned: int
    """Open positions of generators beyond the old fleet (their own shuffle, not a lane): not re-issued."""


def relayout(old: Layout, lanes: int, positions: Mapping[int, int], outstanding: Mapping[int, set[int]],
             ahead: Mapping[int, set[int]], in_buffer: Mapping[int, set[int]]) -> Relaid:
    """The layout of a resume with ``lanes`` generators, from the ledger (``positions``, ``outstanding``,
    ``ahead``) and the positions a durable buffer holds or delivered (``in_buffer``: kept outstanding under their
    keys). Every generator's position becomes the highest it holds; the open positions of old lanes and the
    indices of ``V`` some lane never reached become the first of the new ``V`` (their old keys count as used up:
    no longer outstanding, never re-issued)."""
    n = old.lanes
    gens = set(positions) | {g for g, s in ahead.items() if s} | {g for g, s in in_buffer.items() if s}
    top = {g: max(positions.get(g, 0), max(ahead.get(g, ()), default=0), max(in_buffer.get(g, ()), default=0))
           for g in gens}
    last = -1  # the highest place in V any old lane drew
    for j in range(n):
        drawn = top.get(j, 0) - old.base.get(j, 0)
        if drawn > 0:
            last = max(last, j + (drawn - 1) * n)
    moved_v: list[int] = []
    new_out: dict[int, set[int]] = {}
    abandoned = 0
    for g in sorted(gens | set(range(n))):
        b, t, p = old.base.get(g, 0), top.get(g, 0), positions.get(g, 0)
        buf, ah, out = in_buffer.get(g, set()), ahead.get(g, set()), outstanding.get(g, set())
        open_ = {s for s in out if s > b} | {s for s in range(p + 1, t + 1) if s not in ah}
        keep = {s for s in out if s <= b or s in buf} | {s for s in open_ if s in buf}
        if keep:
            new_out[g] = keep
        if g < n:
            moved_v.extend(g + (s - b - 1) * n for s in open_ - buf)
            v = g + max(t - b, 0) * n  # the lane's first place not drawn
            while v <= last:
                moved_v.append(v)
                v += n
        else:
            abandoned += len(open_ - buf)
    moved = sorted(old.at(v) for v in moved_v)
    ranges: list[tuple[int, int]] = []
    for x in moved:
        if ranges and ranges[-1][1] == x:
            ranges[-1] = (ranges[-1][0], x + 1)
        else:
            ranges.append((x, x + 1))
    rest, tail = old.suffix(last + 1)
    layout = Layout(int(lanes), {g: t for g, t in top.items() if t}, ranges + rest, tail)
    return Relaid(layout, {g: t for g, t in top.items()}, new_out, len(moved), abandoned)


def file_prompts_at(records: list[dict[str, Any]], text_field: str, seed: int,
                    indices: Iterable[int]) -> Iterator[Any]:
    """The prompts at ascending global ``indices`` of ``prompts.files.epochs``' sequence (the same seeded
    order per epoch; lane ``i`` of ``n`` is indices ``i, i + n, ...``)."""
    from async_rlhf.prompts.base import to_prompt

    if not records:
        raise ValueError("the prompt file holds no records")
    prompts = [to_prompt(r, text_field) for r in records]
    rng = random.Random(seed)
    order: list[int] = []
    epoch = -1
    for k in indices:
        e, offset = divmod(k, len(prompts))
        if e < epoch:
            raise ValueError(f"global indices must ascend; {k} comes after epoch {epoch}")
        while epoch < e:
            order = list(range(len(prompts)))
            rng.shuffle(order)
            epoch += 1
        yield prompts[order[offset]]


def items_at(items: Iterable[Any], indices: Iterable[int]) -> Iterator[Any]:
    """The items of ``items`` at ascending ``indices`` (a Python prompt source, read once)."""
    it = iter(items)
    place = -1
    item: Any = None
    for k in indices:
        if k <= place:
            raise ValueError(f"indices must ascend; {k} comes after {place}")
        while place < k:
            item = next(it)
            place += 1
        yield item


class OffsetStream:
    """A ``PromptStream`` over positions after ``base``: its positions are numbered from ``base + 1`` (a layout's
    later positions; those up to ``base`` belong to an earlier layout and are never replayed)."""

    def __init__(self, stream: Any, base: int) -> None:
        self._stream = stream
        self.base = base

    @property
    def position(self) -> int:
        return self._stream.position + self.base

    @property
    def reissue_left(self) -> int:
        return int(self._stream.reissue_left)

    @property
    def next_is_contiguous(self) -> bool:
        return bool(self._stream.next_is_contiguous)

    def __iter__(self) -> OffsetStream:
        return self

    def __next__(self) -> tuple[int, Any]:
        seq, problem = next(self._stream)
        return seq + self.base, problem


def lane_source(cfg: Any, layout: Layout, lane: int) -> Any:
    """Lane ``lane`` of ``layout`` over the run's file or Python prompt source (``prompts.source``), as a
    ``PromptSource`` whose first prompt is that of position ``layout.base[lane] + 1``."""
    from async_rlhf.prompts.base import IterablePrompts

    p = cfg.prompts
    indices = layout.lane_globals(lane)
    if p.source == "file":
        from async_rlhf.prompts.files import load_records

        return IterablePrompts(file_prompts_at(load_records(p.path), p.text_field, cfg.train.seed, indices),
                               p.text_field)
    if p.source == "python":
        from async_rlhf.rewards.base import load_callable

        return IterablePrompts(items_at(load_callable(p.path, "prompts.path")(), indices), p.text_field)
    raise ValueError(f"prompts.source={p.source} has no lanes (only file and python sources are dealt)")


def offset_stream(source: Any, base: int, start: int = 0, reissue: Sequence[int] = (),
                  skip: Sequence[int] = ()) -> Any:
    """The generator's ``PromptStream`` over ``source``, whose first prompt is position ``base + 1``; without a
    position (a generator run without ``resume_stream``, e.g. by a benchmark), from the start."""
    if not base:
        return PromptStream(source, start=start, reissue=reissue, skip=skip)
    if start < base or any(r <= base for r in reissue):
        raise ValueError(f"positions up to {base} belong to an earlier layout: start {start}, reissue {reissue}")
    return OffsetStream(PromptStream(source, start=start - base, reissue=[r - base for r in reissue],
                                     skip=[s - base for s in skip if s > base]), base)
