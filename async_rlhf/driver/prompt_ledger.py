"""The driver's ledger of prompts: which were drawn, which trained, which must be issued again (pure).

A prompt's key is ``<generator id>:<position in its stream>`` (see ``generator/stream.py``). The driver
feeds this ledger the generators' stream positions and, step by step, the group ids the learners trained.
From it come the data position of a checkpoint and the re-issue plan of a restarted generator:

    drawn (1..position)  =  trained  +  outstanding (in flight, in the buffer, or lost with a process)
    restart / resume:   re-issue  outstanding - still in the buffer,   skip  in the buffer beyond position

Its size is bounded by what is open, not by the run's length (issue 44, defect 11): per generator a position,
the outstanding positions below it and the trained ones beyond it (``ahead``). Which keys were trained follows
from those (:meth:`PromptLedger.is_trained`), so no set of every trained key is kept, and what the driver asks
the buffer at a restart is the ledger's open part (:meth:`PromptLedger.windows`, ``async_rlhf.prompt_window``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from async_rlhf.generator.lanes import Layout, Relaid, relayout
from async_rlhf.generator.stream import keys_of_group

REISSUED_KEPT = 4096


def split_key(key: str) -> tuple[int, int]:
    gen, _, seq = key.partition(":")
    return int(gen), int(seq)


def held_positions(group_ids: Iterable[str]) -> dict[int, set[int]]:
    """Per generator, the stream positions the groups ``group_ids`` (e.g. those a durable buffer holds) use up."""
    held: dict[int, set[int]] = {}
    for key in (k for g in group_ids for k in keys_of_group(g)):
        gen, seq = split_key(key)
        held.setdefault(gen, set()).add(seq)
    return held


@dataclass
class StreamPlan:
    """How a (re)started generator continues its prompt stream."""

    position: int
    reissue: list[int]
    skip: list[int]


@dataclass
class PromptLedger:
    positions: dict[int, int] = field(default_factory=dict)
    outstanding: dict[int, set[int]] = field(default_factory=dict)
    ahead: dict[int, set[int]] = field(default_factory=dict)
    """Trained positions beyond the last position seen (a generator drew and finished them between polls)."""
    duplicates: list[str] = field(default_factory=list)
    """Keys trained a second time: must stay empty (exactly-once)."""
    reissued: dict[int, list[int]] = field(default_factory=dict)
    """Positions re-issued per generator, the newest ``REISSUED_KEPT`` (for tests and tools; no decision reads it)."""
    layout: Layout | None = None
    """How a file or Python source is dealt to the fleet (``generator/lanes.py``): the fleet size the positions
    are strides of; None until the fleet starts (a checkpoint records it)."""

    def observe_position(self, gen: int, position: int) -> None:
        old = self.positions.get(gen, 0)
        if position <= old:
            return
        ahead = self.ahead.setdefault(gen, set())
        fresh = {s for s in range(old + 1, position + 1) if s not in ahead}
        self.outstanding.setdefault(gen, set()).update(fresh)
        ahead.difference_update(range(old + 1, position + 1))
        self.positions[gen] = position

    def observe_trained(self, group_ids: Iterable[str]) -> None:
        """Groups trained or dropped as uninformative: their prompts, and those passed over before them, are
        used up."""
        for key in (k for gid in group_ids for k in keys_of_group(gid)):
            gen, seq = split_key(key)
            if self.is_trained(gen, seq):
                self.duplicates.append(key)
                continue
            if seq <= self.positions.get(gen, 0):
                self.outstanding.setdefault(gen, set()).discard(seq)
            else:
                self.ahead.setdefault(gen, set()).add(seq)

    def is_trained(self, gen: int, seq: int) -> bool:
        """Whether prompt ``gen:seq`` was used up: drawn (up to the position) and not outstanding, or ahead."""
        if seq <= self.positions.get(gen, 0):
            return seq not in self.outstanding.get(gen, ())
        return seq in self.ahead.get(gen, ())

    @property
    def trained(self) -> set[str]:
        """Every key used up, spelled out (for tests and tools: as long as the run; the ledger keeps no such set)."""
        out = {f"{g}:{s}" for g, p in self.positions.items() for s in range(1, p + 1)
               if s not in self.outstanding.get(g, ())}
        return out | {f"{g}:{s}" for g, seqs in self.ahead.items() for s in seqs}

    def windows(self, gens: Iterable[int] | None = None) -> dict[int, tuple[int, set[int]]]:
        """The open part of the ledger per generator (all it knows, or ``gens``): its position and outstanding
        positions. A group outside it was trained already (``async_rlhf.prompt_window.is_open``)."""
        wanted = sorted(self.positions) if gens is None else sorted(set(gens))
        return {g: (self.positions.get(g, 0), set(self.outstanding.get(g, ()))) for g in wanted}

    def size(self) -> int:
        """Positions the ledger holds (outstanding, ahead, re-issued): bounded by what is open, not the run."""
        return sum(len(v) for d in (self.outstanding, self.ahead, self.reissued) for v in d.values())

    def plan(self, gen: int, in_buffer: Iterable[str] = ()) -> StreamPlan:
        """Stream plan of generator ``gen`` (re)starting now; ``in_buffer``: group ids the buffer holds, has
        delivered or has trained (they need no second issue)."""
        position = self.positions.get(gen, 0)
        held = [split_key(k) for g in in_buffer for k in keys_of_group(g)]
        mine = {seq for g, seq in held if g == gen}
        base = self.layout.base.get(gen, 0) if self.layout is not None else 0  # before: an earlier layout's
        reissue = sorted(s for s in self.outstanding.get(gen, set()) - mine if s > base)
        skip = sorted({s for s in mine if s > position} | self.ahead.get(gen, set()))
        kept = self.reissued.setdefault(gen, [])
        kept.extend(reissue)
        del kept[:-REISSUED_KEPT]
        return StreamPlan(position, reissue, skip)

    def relayout(self, lanes: int, in_buffer: Iterable[str] = ()) -> Relaid:
        """Deal a file or Python source to ``lanes`` generators where the layout had another fleet size (a resume
        with another ``--generators``, ``lanes.relayout``); ``in_buffer``: group ids a durable buffer holds or
        delivered (trained later under their keys). The open positions of the old lanes are dealt again under
        new keys: no longer outstanding here."""
        old = self.layout if self.layout is not None else Layout.default(lanes)
        held = held_positions(in_buffer)
        out = relayout(old, lanes, self.positions, self.outstanding, self.ahead, held)
        self.layout, self.positions, self.outstanding = out.layout, dict(out.positions), out.outstanding
        self.ahead = {}
        return out

    def to_state(self) -> dict[str, Any]:
        """The data position of a checkpoint (JSON)."""
        return {str(g): {"position": p, "pending": sorted(self.outstanding.get(g, set())),
                         "skip": sorted(self.ahead.get(g, set()))} for g, p in sorted(self.positions.items())}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PromptLedger:
        led = cls()
        for g, s in state.items():
            gen = int(g)
            led.positions[gen] = int(s["position"])
            led.outstanding[gen] = {int(x) for x in s["pending"]}
            led.ahead[gen] = {int(x) for x in s.get("skip", [])}
        return led
