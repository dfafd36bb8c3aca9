"""Sampling policies: which held groups a learner gets, and what makes room when the buffer is full.

    policy        delivers                                  when full (held + delivered >= capacity)
    fifo          oldest arrival first (default)            put answers "full"; the generator retries
    freshest      highest min token version first           put answers "full"
    evict_stale   oldest arrival first                      the held group with the oldest min version is
                                                            dropped ("evicted") if the incoming one is fresher,
                                                            else "full"

Groups past ``max_staleness`` are dropped before any policy looks at them (see admission.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from async_rlhf.buffer.store import StoredGroup

POLICIES = ("fifo", "freshest", "evict_stale")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"buffer.policy={policy!r}: use one of {', '.join(POLICIES)}")
    return policy


def select(policy: str, held: Iterable[StoredGroup], n: int) -> list[StoredGroup]:
    """The ``n`` groups to deliver next, in delivery order."""
    if policy == "freshest":
        return heapq.nsmallest(n, held, key=lambda g: (-g.min_version, g.seq))
    return heapq.nsmallest(n, held, key=lambda g: g.seq)


def victim(policy: str, held: Iterable[StoredGroup], incoming_min_version: int) -> StoredGroup | None:
    """The held group a full buffer evicts to admit a fresher one (only under ``evict_stale``)."""
    if policy != "evict_stale":
        return None
    oldest = min(held, key=lambda g: (g.min_version, g.seq), default=None)
    if oldest is None or oldest.min_version >= incoming_min_version:
        return None
    return oldest
