"""How a receiver follows the push group's epochs: joining, entering an epoch's group, learning what the next
push is (a store header, or the first chunk arriving on receives posted for it), leaving and joining again.

Apart from :mod:`async_rlhf.sync.receiver`'s data path (posting receives, the transfer, the acknowledgement,
staging and apply), which it serves: :class:`EpochFollower` is a mixin of :class:`~async_rlhf.sync.receiver.Receiver`
and reads its attributes (``store``, ``me``, ``transport``, ``epoch``, ``_k``, ``_pg``, ``_posted`` ...).
The protocol itself is drawn in :mod:`async_rlhf.sync.protocol`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from async_rlhf.sync import protocol as P
from async_rlhf.sync.group import SyncError, SyncTimeout, left
from async_rlhf.sync.transport import Transport

log = logging.getLogger(__name__)

IDLE_SLICE_S = 0.05
"""While pre-posted for the next push, how often a member asks the store whether a new epoch came instead."""
REJOINED = P.Header(next_epoch=-1)
"""What :meth:`EpochFollower._next_header` returns after joining again or after an aborted push: read the next
header afresh."""


class Excluded(SyncError):
    """This member was dropped from the push group (it missed a deadline, or a restarted process took
    over its id). The next ``join`` or ``receive`` asks to join again, as a new incarnation."""


class Cancelled(SyncError):
    """This receiver was cancelled (``Receiver.cancel``: its owner replaced it); it receives nothing more."""


@dataclass
class Posted:
    """The receives posted for push ``k`` of ``epoch`` into receive slot ``slot``, one per chunk (they stay posted
    across a fetch that timed out)."""

    epoch: int
    k: int
    works: list[dist.Work]
    slot: int


class EpochFollower:
    """Mixin of :class:`~async_rlhf.sync.receiver.Receiver`: membership and the epoch/header protocol."""

    store: dist.TCPStore
    me: P.Member
    transport: Transport
    timeout_s: float
    epoch: int | None
    _k: int
    _pg: dist.ProcessGroup | None
    _works: list[dist.Work]
    _world: int
    _queued: bool
    _cancelled: threading.Event
    _posted: Posted | None
    _expect: tuple | None

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise Cancelled(f"member {self.me.id}: this receiver was cancelled")

    def _wait_keys(self, keys: list[str], deadline: float, what: str) -> None:
        """Wait until every key exists, asking the store every ``IDLE_SLICE_S`` (as the pre-posted path does), so
        that ``cancel`` is seen within one slice. Not a timed ``store.wait`` per slice: c10d logs two warning
        lines for each one that times out, 20 lines a second from every idle generator."""
        while True:
            self._check_cancelled()
            if self.store.check(keys):
                return
            if left(deadline) <= 0:
                raise SyncTimeout(f"timed out waiting for {what}")
            time.sleep(min(IDLE_SLICE_S, max(left(deadline), 0.0)))

    def join(self, timeout_s: float | None = None) -> int:
        """Ask to join and wait until the sender admits this member (at ``form`` or at its next push);
        returns the epoch. A joiner must then call ``receive`` promptly: the push that admitted it
        is already on its way."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        self._check_cancelled()
        if not self._queued:
            self._ask_to_join()
        key = P.admit_key(self.me)
        self._wait_keys([key], deadline, f"admission of {self.me.id} to the push group (is the sender pushing?)")
        self._queued = False
        epoch = int(P.decode(self.store.get(key))["epoch"])
        self._enter(epoch, deadline)
        return epoch

    def _enter(self, epoch: int, deadline: float) -> None:
        self._wait_keys([P.members_key(epoch)], deadline, f"the member list of epoch {epoch}")
        members = P.decode_members(self.store.get(P.members_key(epoch)))
        self.transport.retire(self._pg, self._works)
        self._pg, self._works, self.epoch, self._k, self._posted = None, [], None, 0, None
        if self.me not in members:
            raise Excluded(f"member {self.me.id} was dropped from the push group at epoch {epoch}; "
                           "join again to come back")
        self.epoch = epoch
        rank = members.index(self.me) + 1
        self._world = len(members) + 1
        self.store.set(P.ready_key(epoch, self.me.id), self.me.nonce)
        self._wait_keys([P.go_key(epoch)], deadline, f"the sender to open epoch {epoch}")
        self._pg = self.transport.open(dist.PrefixStore(P.pg_prefix(epoch), self.store), rank, len(members) + 1,
                                       self.timeout_s, ["the sender", *(m.id for m in members)])
        log.info("member %s entered push group epoch %d as rank %d of %d", self.me.id, epoch, rank,
                 len(members) + 1)

    def _store_header(self, e: int, k: int) -> P.Header | None:
        key = P.header_key(e, k)
        return P.Header.decode(self.store.get(key)) if self.store.check([key]) else None

    def _next_header(self, e: int, k: int, deadline: float) -> P.Header | None:
        """What push k of epoch e is. Pre-posted (fast path): None once its first chunk arrived on the group, or
        the store's move to the next epoch. Otherwise: the store's header, whichever it is."""
        if self._posted is None:
            self._wait_keys([P.header_key(e, k)], deadline, f"push {k} of epoch {e} (is the sender pushing?)")
            return self._store_header(e, k)
        moved: list[P.Header] = []
        aborted: list[str] = []

        def next_epoch() -> str | None:  # between slices: did the sender open a new epoch instead of pushing,
            if self._cancelled.is_set():  # or give up on push k (another member died under it)?
                return "this receiver was cancelled"
            header = self._store_header(e, k)
            if header is not None and header.next_epoch is not None:
                moved.append(header)
                return f"the sender opened epoch {header.next_epoch}"
            if self.store.check([P.abort_key(e, k)]):
                aborted.append(self.store.get(P.abort_key(e, k)).decode())
                return "the sender aborted it"
            return None

        try:
            self.transport.wait(self._posted.works[0], deadline, f"push {k} of epoch {e} (is the sender pushing?)",
                                next_epoch, IDLE_SLICE_S)
            return None
        except SyncTimeout:
            raise  # no push in time: the receives stay posted for the next fetch
        except SyncError as exc:
            self._check_cancelled()  # replaced by its owner: never join again
            # the sender retired the group (a new epoch), or the receives outlived the group's own timeout
            header = moved[0] if moved else self._store_header(e, k)
            if header is not None and header.next_epoch is not None:
                self._posted = None
                return header
            if aborted:  # a victim: say so, then wait for the sender's next push (it opens a new epoch)
                with contextlib.suppress(Exception):
                    self.store.set(P.ack_key(e, k, self.me.id), f"{P.ABORTED}: {aborted[0]}"[:500])
                self._posted, self._expect, self._k = None, None, k + 1
                return REJOINED
            log.warning("member %s: the receives posted for push %d of epoch %d failed (%s); joining again",
                        self.me.id, k, e, exc)
            # a victim (another member's death breaks every pair with it, or the group timed out): if the sender
            # pushes k into this broken group, this report keeps it from blaming this member, which is back
            # by the next push as a new incarnation
            with contextlib.suppress(Exception):
                self.store.set(P.ack_key(e, k, self.me.id), f"{P.ABORTED}: posted receives failed ({exc})"[:500])
            self._leave(join_again=False)
            self.join(left(deadline))
            return REJOINED

    def _leave(self, join_again: bool) -> None:
        """Leave the current group; with ``join_again``, ask to join as a new incarnation right away (the
        next fetch waits for the admission)."""
        self._posted, self._expect = None, None
        self.transport.retire(self._pg, self._works)
        self._pg, self._works, self.epoch = None, [], None
        if join_again:
            self._ask_to_join()

    def _ask_to_join(self) -> None:
        # every request is a new incarnation: its admission key cannot be confused with an old one
        self.me = P.Member(self.me.id, uuid.uuid4().hex[:12])
        self.store.queue_push(P.JOIN_QUEUE, P.encode_join(self.me))
        self._queued = True
