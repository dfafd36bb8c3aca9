"""Where the buffer keeps finished prompt groups. One small interface, chosen by ``buffer.store``.

The store holds groups in their validated wire form (a msgpack-native map), so the service hands them
to learners without re-encoding. ``memory`` is the embedded default; a Redis Streams store plugs in
behind the same interface.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class StoredGroup:
    group_id: str
    min_version: int
    num_samples: int
    num_tokens: int
    wire: dict[str, Any]


class Store(Protocol):
    def put(self, group: StoredGroup) -> bool:
        """Keep ``group``; False when a group with this id is already held (idempotent put)."""

    def take(self, n: int) -> list[StoredGroup]:
        """Remove and return up to ``n`` groups, oldest first."""

    def peek_all(self) -> list[StoredGroup]:
        """Every held group, oldest first, without removing any."""

    def remove(self, group_ids: list[str]) -> None: ...

    def __len__(self) -> int: ...


class MemoryStore:
    """FIFO in a dict; for one machine or one buffer process."""

    def __init__(self) -> None:
        self._groups: OrderedDict[str, StoredGroup] = OrderedDict()

    def put(self, group: StoredGroup) -> bool:
        if group.group_id in self._groups:
            return False
        self._groups[group.group_id] = group
        return True

    def take(self, n: int) -> list[StoredGroup]:
        out = []
        while self._groups and len(out) < n:
            out.append(self._groups.popitem(last=False)[1])
        return out

    def peek_all(self) -> list[StoredGroup]:
        return list(self._groups.values())

    def remove(self, group_ids: list[str]) -> None:
        for gid in group_ids:
            self._groups.pop(gid, None)

    def __len__(self) -> int:
        return len(self._groups)


def make_store(kind: str, **_: Any) -> Store:
    if kind == "memory":
        return MemoryStore()
    raise ValueError(f"buffer.store={kind!r} is not available in this build; use buffer.store=memory")
