"""Receive slots of a weight-push member: the byte buffers a version arrives in, and which one is free.

Kept apart from :mod:`async_rlhf.sync.receiver`, which owns membership, epochs and the data path: this module
only tracks the ``n`` (1 or 2) arenas, each holding every bucket, and their states, shared by the fetch
thread and the thread that applies (the engine loop) under one condition::

    slot states:   free --post--> receiving --acked--> staged --apply--> applying --done--> free
                                                          '--a newer version staged (coalesced)--> free

"receiving" is the receiver's to know (the slot of its posted receives): it passes that slot in.

Each slot carries the version it was last filled with (None once receives are posted into it, or before any):
:meth:`ReceiveSlots.claim` refuses to load a slot that does not hold the version asked for, so an apply that
races a receive into the same slot, or a :class:`Staged` handed to another receiver, never loads wrong bytes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from async_rlhf.sync.group import SyncError, SyncTimeout, left
from async_rlhf.sync.layout import Bucket
from async_rlhf.sync.tensors import arena_offsets, named_views
from async_rlhf.sync.transport import Transport

__all__ = ["ReceiveSlots", "Staged"]


@dataclass(frozen=True)
class Staged:
    """A version received whole into the buffer and acknowledged, not loaded yet."""

    version: int
    epoch: int
    k: int
    slot: int
    metrics: dict[str, float]


class ReceiveSlots:
    """``n`` arenas of one layout (allocated on first use, reused by every later push) and their named views,
    with the staged and applying slot guarded by a condition."""

    def __init__(self, n: int) -> None:
        if n not in (1, 2):
            raise ValueError(f"buffers must be 1 or 2, got {n}")
        self.n = n
        self._cond = threading.Condition()
        self._staged: int | None = None  # the newest version received and not yet taken by apply
        self._applying: int | None = None
        self._filled: list[int | None] = [None] * n  # the version each slot holds whole (None: none)
        self.coalesced = 0
        """Versions received and never applied because a newer one arrived first."""

    def use_layout(self, buckets: list[Bucket]) -> None:
        """Forget the arenas: the next :meth:`arena` allocates them for ``buckets``."""
        self._buckets = buckets
        self._offsets, self.arena_bytes = arena_offsets(buckets)
        self._arenas: list[torch.Tensor | None] = [None] * self.n
        self._views: list[list[list[tuple[str, torch.Tensor]]]] = [[] for _ in range(self.n)]

    def arena(self, slot: int, transport: Transport) -> torch.Tensor:
        """The byte buffer of ``slot``, holding every bucket (allocated on ``transport``'s device)."""
        raw = self._arenas[slot]
        if raw is None:
            raw = self._arenas[slot] = transport.empty(self.arena_bytes)
            parts = zip(self._offsets, self._buckets)
            self._views[slot] = [named_views(raw[off:off + b.nbytes], b) for off, b in parts]
        return raw

    def weights(self, slot: int, per_bucket: bool) -> Iterator:
        """What ``load`` consumes: the (name, tensor) views into ``slot`` (built with its arena), or with
        ``per_bucket`` one list of them per bucket."""
        for views in self._views[slot]:
            if per_bucket:
                yield views
            else:
                yield from views

    def free(self, keep_staged: bool, posted: int | None, reserve: bool = True) -> int | None:
        """A slot to receive into: not being applied, not ``posted`` (holding posted receives) and, with
        ``keep_staged``, not holding the newest staged version. Without it the staged slot is taken last
        (superseded). ``reserve``: the caller posts receives into it now, so it no longer holds a version."""
        with self._cond:
            busy = {self._applying, posted}
            free = [s for s in range(self.n) if s not in busy and s != self._staged]
            slot = free[0] if free else None
            if slot is None and not keep_staged and self._staged is not None and self._staged not in busy:
                slot = self._staged
            if slot is not None and reserve:
                self._filled[slot] = None
                if self._staged == slot:
                    self._staged = None
            return slot

    def wait_for_free(self, deadline: float, stop: Callable[[], bool] | None = None) -> None:
        """Block (the fetch thread, no receives posted) until a slot can take the next push without dropping
        the staged version, or until ``stop()`` (asked every 50 ms) says the receiver is closing."""
        with self._cond:
            while self.free(keep_staged=True, posted=None, reserve=False) is None:
                if left(deadline) <= 0:
                    raise SyncTimeout("no free receive slot: the staged version was not applied in time")
                if stop is not None and stop():
                    return
                self._cond.wait(min(left(deadline), 0.05 if stop is not None else 0.5))

    def staged_into(self, slot: int, version: int) -> None:
        """``version`` arrived whole in ``slot``: it is the newest staged one (the one it replaces is coalesced)."""
        with self._cond:
            if self._staged is not None and self._staged != slot:
                self.coalesced += 1  # never applied: a newer version is here
            self._staged = slot
            self._filled[slot] = version
            self._cond.notify_all()

    def holds(self, slot: int) -> int | None:
        """The version ``slot`` holds whole (None: none, or receives are posted into it)."""
        with self._cond:
            return self._filled[slot]

    def claim(self, slot: int, version: int) -> None:
        """Mark ``slot`` as being applied (no receive is posted into it until :meth:`release`) if it holds
        ``version``; raises :class:`SyncError` otherwise (a receive reused it, or it never held that version)."""
        with self._cond:
            if self._applying == slot:
                return
            if self._applying is not None:
                raise SyncError(f"receive slot {self._applying} is being applied: one apply at a time")
            if not 0 <= slot < self.n or self._filled[slot] != version:
                held = self._filled[slot] if 0 <= slot < self.n else None
                raise SyncError(f"receive slot {slot} no longer holds version {version} (it holds {held}): "
                                "not loading it")
            self._applying = slot
            if self._staged == slot:
                self._staged = None

    def release(self, slot: int) -> None:
        """End :meth:`claim` of ``slot`` (loaded, or given up)."""
        with self._cond:
            if self._applying == slot:
                self._applying = None
            self._cond.notify_all()

    @contextlib.contextmanager
    def applying(self, slot: int, version: int) -> Iterator[None]:
        """``slot`` is being loaded meanwhile (claimed first if it is not yet; see :meth:`claim`): no receive
        goes into it; free again afterwards."""
        self.claim(slot, version)
        try:
            yield
        finally:
            with self._cond:
                self._applying = None
                self._cond.notify_all()
