r"""Where the buffer keeps prompt groups and the ledger of what became of them. One interface, two stores.

Every group id is, at any time, in exactly one state, and the store owns that state machine::

      put(awaiting)              reward
    (new) ------> awaiting_reward -------.
      |              |                    v
      |  put         | drop(reward_timeout)         deliver(consumer)            ack
      '--------------|------------------> held -------------------------> delivered -----> trained   (final)
                     |                     ^  \                              |  |
                     |                     |   \ drop(reason)   redeliver    |  | drop(reason)
                     '---------------------|----'---------> dropped <--------|--'          (final, with a reason)
                                           '---------------------------------'
                                             visibility timeout / consumer declared dead

A group put with ``rewards_pending`` waits in ``awaiting_reward`` (complete, never delivered) until its
rewards arrive or ``buffer.reward_deadline_s`` passes.

Each transition is one call, and it carries ``meta``: the absolute values of the admission and service
counters after the transition. The memory store keeps them in a dict; the Redis store
(:mod:`async_rlhf.buffer.redis_store`) writes transition and counters in one atomic script, so a restarted
service finds both consistent. The single writer is the buffer service, which decides with the in-memory
view this class keeps (the Redis store keeps the same view as a mirror and reloads it at start).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgpack

HELD, DELIVERED, TRAINED, DROPPED = "held", "delivered", "trained", "dropped"
AWAITING = "awaiting_reward"


@dataclass
class StoredGroup:
    group_id: str
    min_version: int
    num_samples: int
    num_tokens: int
    data: bytes | memoryview
    """The group's msgpack bytes exactly as a generator sent them (validated); learners receive these bytes.
    A large group is a view of the received ZeroMQ frame (no copy)."""
    seq: int = 0
    """Arrival order (FIFO key); a redelivered group keeps its place at the front."""
    deliveries: int = 0
    """How many times it was handed to a learner (a late ack is accepted once this is above 0)."""
    since: float = field(default_factory=time.time)
    """Wall-clock time it entered the store (an awaiting group's reward deadline counts from it)."""

    @property
    def wire(self) -> dict[str, Any]:
        """The decoded wire map (for tools and tests; the service passes ``data`` along untouched)."""
        return msgpack.unpackb(self.data, raw=False)


@dataclass
class Delivery:
    consumer: str
    version: int
    at: float = field(default_factory=time.time)
    """Wall-clock time of the delivery (the Redis store recovers it from the pending entry's idle time)."""


@runtime_checkable
class Store(Protocol):
    """What :class:`~async_rlhf.buffer.logic.BufferLogic` needs from a store: the reads of its in-memory view
    and one call per transition. :class:`MemoryStore` keeps only the view; the Redis store keeps the same view
    as a mirror and writes every transition durably. :func:`async_rlhf.buffer.build.make_store` picks one."""

    durable: bool
    name: str

    def state(self, group_id: str) -> str | None: ...
    def peek_all(self) -> list[StoredGroup]: ...
    def held(self) -> Iterable[StoredGroup]: ...
    def held_ids(self) -> Iterable[str]: ...
    def held_in_order(self) -> bool: ...
    def held_floor(self) -> int | None: ...
    def set_held_floor(self, floor: int | None) -> None: ...
    def get_held(self, group_id: str) -> StoredGroup | None: ...
    def awaiting(self) -> dict[str, StoredGroup]: ...
    def delivered(self) -> dict[str, Delivery]: ...
    def num_delivered(self) -> int: ...
    def trained(self) -> set[str]: ...
    def dropped(self) -> dict[str, str]: ...
    def meta(self) -> dict[str, int]: ...
    def __len__(self) -> int: ...
    def put(self, group: StoredGroup, meta: Mapping[str, int] | None = None, *, awaiting: bool = False) -> bool: ...
    def put_many(self, groups: list[StoredGroup], meta: Mapping[str, int] | None = None, *,
                 awaiting: bool = False) -> list[bool]: ...
    def reward(self, group_id: str, data: bytes, meta: Mapping[str, int] | None = None) -> bool: ...
    def deliver(self, group_ids: list[str], consumer: str, version: int,
                meta: Mapping[str, int] | None = None) -> list[StoredGroup]: ...
    def ack(self, group_ids: list[str], meta: Mapping[str, int] | None = None) -> list[str]: ...
    def drop(self, group_ids: list[str], reason: str, meta: Mapping[str, int] | None = None) -> list[str]: ...
    def redeliver(self, group_ids: list[str], meta: Mapping[str, int] | None = None) -> list[str]: ...
    def renew(self, group_ids: list[str], consumer: str) -> list[str]: ...
    def save_meta(self, meta: Mapping[str, int]) -> None: ...
    def save_admit(self, request_id: str, granted: int, version: int, keep: int, meta: Mapping[str, int]) -> None: ...
    def admits(self) -> dict[str, tuple[int, int]]: ...
    def close(self) -> None: ...


class MemoryStore:
    """The embedded default: dicts in this process, nothing survives it. Also the Redis store's mirror."""

    durable = False
    name = "memory"

    def __init__(self) -> None:
        self._held: dict[str, StoredGroup] = {}
        self._awaiting: dict[str, StoredGroup] = {}
        self._delivered: dict[str, tuple[StoredGroup, Delivery]] = {}
        self._trained: set[str] = set()
        self._dropped: dict[str, str] = {}
        self._meta: dict[str, int] = {}
        self._seq = 0
        self._in_order = True
        """The held dict iterates in arrival (seq) order: FIFO can take its first n without sorting."""
        self._floor: int | None = None
        """A lower bound of the held groups' min versions (None: unknown); spares the staleness scan."""

    # -- reads ------------------------------------------------------------------------------
    def state(self, group_id: str) -> str | None:
        if group_id in self._held:
            return HELD
        if group_id in self._awaiting:
            return AWAITING
        if group_id in self._delivered:
            return DELIVERED
        if group_id in self._trained:
            return TRAINED
        if group_id in self._dropped:
            return DROPPED
        return None

    def peek_all(self) -> list[StoredGroup]:
        """Held groups in arrival order."""
        return sorted(self._held.values(), key=lambda g: g.seq)

    def held(self) -> Iterable[StoredGroup]:
        """Held groups, unordered (cheap)."""
        return self._held.values()

    def held_ids(self) -> Iterable[str]:
        """Held group ids, in the order :meth:`held` iterates."""
        return self._held.keys()

    def held_in_order(self) -> bool:
        """True when :meth:`held` iterates oldest arrival first (no redelivered group is back in it)."""
        if not self._held:
            self._in_order = True
        return self._in_order

    def held_floor(self) -> int | None:
        """No held group has a min version below this (None: unknown, scan them)."""
        return self._floor

    def set_held_floor(self, floor: int | None) -> None:
        self._floor = floor

    def _hold(self, group: StoredGroup) -> None:
        if self._held and group.seq < self._seq:
            self._in_order = False
        self._held[group.group_id] = group
        if self._floor is not None and group.min_version < self._floor:
            self._floor = group.min_version

    def get_held(self, group_id: str) -> StoredGroup | None:
        return self._held.get(group_id)

    def awaiting(self) -> dict[str, StoredGroup]:
        """Groups put with their rewards pending, by id."""
        return self._awaiting

    def delivered(self) -> dict[str, Delivery]:
        return {gid: d for gid, (_, d) in self._delivered.items()}

    def num_delivered(self) -> int:
        return len(self._delivered)

    def trained(self) -> set[str]:
        return self._trained

    def dropped(self) -> dict[str, str]:
        return self._dropped

    def meta(self) -> dict[str, int]:
        return dict(self._meta)

    def __len__(self) -> int:
        return len(self._held)

    # -- transitions ------------------------------------------------------------------------
    def put(self, group: StoredGroup, meta: Mapping[str, int] | None = None, *, awaiting: bool = False) -> bool:
        """new -> held (or awaiting_reward); False (and nothing changes) when the id is known in any state."""
        if self.state(group.group_id) is not None:
            return False
        self._seq += 1
        group.seq = group.seq or self._seq
        if awaiting:
            self._awaiting[group.group_id] = group
        else:
            self._hold(group)
        self._seq = max(self._seq, group.seq)
        self._save(meta)
        return True

    def put_many(self, groups: list[StoredGroup], meta: Mapping[str, int] | None = None, *,
                 awaiting: bool = False) -> list[bool]:
        """:meth:`put` of several groups in one transition (one Redis round trip for the durable store).

        The same steps as :meth:`put`, inlined: this is the service's hot path (one call per put request).
        """
        out = []
        known = self._known
        target = self._awaiting if awaiting else None
        for g in groups:
            gid = g.group_id
            if known(gid):
                out.append(False)
                continue
            self._seq += 1
            g.seq = g.seq or self._seq
            if target is None:
                self._hold(g)
            else:
                target[gid] = g
            if g.seq > self._seq:
                self._seq = g.seq
            out.append(True)
        self._save(meta)
        return out

    def _known(self, group_id: str) -> bool:
        """:meth:`state` is not None, without naming the state."""
        return (group_id in self._held or group_id in self._awaiting or group_id in self._delivered
                or group_id in self._trained or group_id in self._dropped)

    def reward(self, group_id: str, data: bytes, meta: Mapping[str, int] | None = None) -> bool:
        """awaiting_reward -> held with the rewarded bytes; it queues as if it arrived now."""
        group = self._awaiting.pop(group_id, None)
        if group is None:
            return False
        self._seq += 1
        group.data, group.seq = data, self._seq
        self._hold(group)
        self._save(meta)
        return True

    def deliver(self, group_ids: list[str], consumer: str, version: int,
                meta: Mapping[str, int] | None = None) -> list[StoredGroup]:
        """held -> delivered to ``consumer``; returns the groups in the order asked."""
        out = []
        now = time.time()
        for gid in group_ids:
            g = self._held.pop(gid, None)
            if g is None:
                continue
            g.deliveries += 1
            self._delivered[gid] = (g, Delivery(consumer, version, now))
            out.append(g)
        self._save(meta)
        return out

    def ack(self, group_ids: list[str], meta: Mapping[str, int] | None = None) -> list[str]:
        """delivered (or held again after a redelivery) -> trained; returns the ids that moved."""
        moved = []
        for gid in group_ids:
            if gid in self._delivered:
                del self._delivered[gid]
            elif gid in self._held and self._held[gid].deliveries > 0:
                del self._held[gid]
            else:
                continue
            self._trained.add(gid)
            moved.append(gid)
        self._save(meta)
        return moved

    def drop(self, group_ids: list[str], reason: str, meta: Mapping[str, int] | None = None) -> list[str]:
        """held, awaiting_reward or delivered -> dropped with ``reason``; returns the ids that moved."""
        moved = []
        for gid in group_ids:
            if (self._held.pop(gid, None) is None and self._delivered.pop(gid, None) is None
                    and self._awaiting.pop(gid, None) is None):
                continue
            self._dropped[gid] = reason
            moved.append(gid)
        self._save(meta)
        return moved

    def renew(self, group_ids: list[str], consumer: str) -> list[str]:
        """Restart the visibility timeout of the groups delivered to ``consumer`` among ``group_ids`` (its lease:
        it is still training them); returns their ids."""
        now, renewed = time.time(), []
        for gid in group_ids:
            entry = self._delivered.get(gid)
            if entry is not None and entry[1].consumer == consumer:
                entry[1].at = now
                renewed.append(gid)
        return renewed

    def redeliver(self, group_ids: list[str], meta: Mapping[str, int] | None = None) -> list[str]:
        """delivered -> held (its learner is presumed dead); it keeps its arrival order."""
        moved = []
        for gid in group_ids:
            entry = self._delivered.pop(gid, None)
            if entry is None:
                continue
            self._hold(entry[0])
            moved.append(gid)
        self._save(meta)
        return moved

    def save_meta(self, meta: Mapping[str, int]) -> None:
        self._save(meta)

    def save_admit(self, request_id: str, granted: int, version: int, keep: int, meta: Mapping[str, int]) -> None:
        """Remember the answer to admit ``request_id`` (the last ``keep`` of them) with the counters."""
        self._save(meta)

    def admits(self) -> dict[str, tuple[int, int]]:
        """Remembered admit answers, oldest first: request id -> (granted, version). Memory: none survive."""
        return {}

    def _save(self, meta: Mapping[str, int] | None) -> None:
        if meta:
            self._meta.update(meta)

    def close(self) -> None:
        pass

