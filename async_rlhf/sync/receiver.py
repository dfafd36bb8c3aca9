"""Receiver side of the weight push (inside a generator's vLLM worker). Mirrors the sender.

The receiver owns ``buffers`` byte buffers (slots), each holding every bucket (allocated on first use,
reused by every later push), and receives the push's chunks straight into one of them: nothing is done
per tensor during the transfer (the named views are built once per layout and slot). An update has two
phases, so that the engine stands still only for the second::

    fetch():  post recv(chunk 0..C-1) -> wait all -> ack (allreduce: learns v)  (engine keeps generating,
              (the first push of an epoch: wait(store hdr k) first)               fetch runs on a thread)
    apply():  load(every bucket's named tensors) -> live key (wall time)          (engine paused between
                                                                                 two steps: the swap)

The sender's push completes at the acks (every member holds v, byte-exact); v is live at each member
once it has applied it. With two slots, a fetch that keeps the staged version (``keep_staged``, the
generator's fetch loop) receives v + 1 into the other slot while v waits for the engine's next step
boundary, so the sender never waits for a member to swap; if v + 1 arrives before v was applied, v is
skipped (coalesced) and only v + 1 is loaded. With one slot such a fetch waits until v is applied. The
slots and their states are :mod:`async_rlhf.sync.receive_slots`'s (drawn there).

Loading starts only after the whole version has arrived: vLLM's layerwise reload keeps half-loaded
layers on the meta device if its weight iterator raises, so a push aborted mid-way must never reach the
engine. ``load`` receives an iterator of (name, tensor) and must consume it: vLLM's
``model_runner.reload_weights(weights_iterator=...)`` does, and so does a plain copy loop. The tensors are
views into a slot, valid until that slot receives again, so ``load`` must copy them.

Usage in a generator's worker::

    rx = Receiver(buckets, "gen1", host, port, timeout_s=120)
    rx.join()                      # initial member: returns once the sender forms the group
    ...
    staged = rx.fetch()            # at each update, on a thread while the engine generates (a late
    got = rx.apply(staged, load)   # joiner: before serving; it joins at the next version boundary)
    got = rx.receive(load)         # both at once, standing still
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from async_rlhf.sync import protocol as P
from async_rlhf.sync.group import (
    Aborted,
    SyncError,
    caused_by,
    connect_store,
    last_first,
    left,
    push_timeout_s,
    track,
)
from async_rlhf.sync.layout import Bucket
from async_rlhf.sync.receive_slots import ReceiveSlots, Staged
from async_rlhf.sync.receiver_epochs import REJOINED, Cancelled, EpochFollower, Excluded, Posted
from async_rlhf.sync.tensors import check_cut, layout_digest
from async_rlhf.sync.transport import Transport, make_transport

__all__ = ["Cancelled", "Excluded", "Load", "ReceiveError", "Received", "Receiver", "Staged"]

log = logging.getLogger(__name__)

Load = Callable[[Iterator], object]
"""Consumes an iterator of (name, tensor), or of lists of them (one per bucket) with ``per_bucket``."""


class ReceiveError(SyncError):
    """This member failed to receive or load a pushed version (the sender was told)."""


@dataclass(frozen=True)
class Received:
    version: int
    epoch: int
    metrics: dict[str, float]


class Receiver(EpochFollower):
    """A generator's end of the push group. :meth:`fetch` (and :meth:`prepost`) run on one thread, and
    :meth:`apply` may run on another (the engine loop); the slots between them (:class:`ReceiveSlots`) are
    guarded by a condition."""

    def __init__(self, buckets: list[Bucket], member_id: str, host: str, port: int, backend: str | Transport = "gloo",
                 timeout_s: float = 120.0, slice_s: float = 0.2, buffers: int = 1, min_gbps: float = 0.0) -> None:
        """``buffers``: receive slots (2: the next version arrives while the last one waits to be applied,
        at the cost of a second copy of the weights here). ``backend``: ``sync.backend`` or a
        :class:`Transport`; the receive slots live on its device. ``min_gbps``: once a push starts, its transfer
        may take ``timeout_s`` plus the arena to every member at this rate (as the sender's deadline)."""
        self._slots = ReceiveSlots(buffers)
        self._cancelled = threading.Event()
        # a version waits here in host memory (NCCL: streamed through a bounded CUDA buffer, see transport.py)
        self.transport = backend if isinstance(backend, Transport) else make_transport(backend, host_arena=True)
        backend = self.transport.name
        self.buffers = buffers
        self.me = P.Member(member_id, "")
        P.decode_join(P.encode_join(self.me))  # validates the id (join() draws the nonce)
        self.backend, self.timeout_s, self.slice_s, self.min_gbps = backend, timeout_s, slice_s, min_gbps
        self._world = 2  # members of the current epoch plus the sender (for the transfer's deadline)
        self.store = connect_store(host, port, timeout_s)
        self.epoch: int | None = None
        self.version: int | None = None
        self._k = 0
        self._pg: dist.ProcessGroup | None = None
        self._works: list[dist.Work] = []
        self._queued = False
        self._expect: tuple[int, list[tuple[int, int]], torch.Tensor, str] | None = None
        """(epoch, chunks, buffer, wire digest) of the last push received whole: the next push of that epoch
        has the same wire (the sender opens a new epoch to change it) and no store header, so its receives are
        posted at once (the fast path), into that buffer even if this member changed its layout since (it then
        refuses that push, once acknowledged)."""
        self._posted: Posted | None = None
        """What is posted for the next push (its receives)."""
        self.use_layout(buckets)
        track(self)

    @property
    def member_id(self) -> str:
        return self.me.id

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop receiving, from any thread: a :meth:`fetch` under way (or the next one) raises :class:`Cancelled`
        within about a tenth of a second, without joining the group again. For an owner that replaces this
        receiver with another one (a generator healed under a new member id)."""
        self._cancelled.set()

    @property
    def coalesced(self) -> int:
        """Versions received and never applied because a newer one arrived first."""
        return self._slots.coalesced

    def use_layout(self, buckets: list[Bucket]) -> None:
        """Set the bucket layout (the sender's); the buffer is allocated on the next receive. The same layout
        again changes nothing (receives may be posted into the current buffer)."""
        digest = layout_digest(buckets)
        if digest == getattr(self, "layout_digest", None):
            return
        self.buckets = buckets
        self.chunks: list[tuple[int, int]] = []  # the cut of the last push received (the sender's choice)
        self.layout_digest = digest
        self._slots.use_layout(buckets)

    def arena(self, slot: int = 0) -> torch.Tensor:
        """The byte buffer of ``slot``, holding every bucket (the benchmark also receives its raw broadcast
        into slot 0)."""
        return self._slots.arena(slot, self.transport)

    def _posted_slot(self) -> int | None:
        return self._posted.slot if self._posted is not None else None

    # -- data path ----------------------------------------------------------------------------------
    def fetch(self, timeout_s: float | None = None, keep_staged: bool = False) -> Staged:
        """Wait for the next push addressed to this member and receive all of it into the buffer; then
        acknowledge it (the sender may go on: the bytes are safe here). The engine is not touched, so it
        may keep generating meanwhile (from another thread); :meth:`apply` swaps the version in.

        Follows epoch changes on the way (and joins first if this member is not in the group yet).
        ``keep_staged``: never receive into the slot of a staged version not yet applied (wait for a free
        slot instead): the caller applies the newest staged version from another thread.
        Raises :class:`Excluded` if the sender dropped this member, :class:`ReceiveError` if this push
        failed here (the sender was told), :class:`SyncTimeout` if no push came within ``timeout_s``.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        if self.epoch is None:
            self.join(left(deadline))
        while True:
            self._check_cancelled()
            e, k = self.epoch, self._k
            expect = self._expect
            if keep_staged and self._posted is None:
                self._slots.wait_for_free(deadline, lambda: self._cancelled.is_set())
                self._check_cancelled()
            self.prepost(keep_staged)  # the fast path: no store header
            header = self._next_header(e, k, deadline)
            if header is REJOINED:
                continue
            self._k += 1
            if header is None:  # push k's first chunk is arriving: this member was pre-posted for it
                break
            if header.next_epoch is None:
                break
            self._enter(header.next_epoch, deadline)
        t_header = time.perf_counter()
        if self.min_gbps:  # a multi-GB push to many members: its transfer gets the sender's allowance
            deadline = max(deadline, time.monotonic() + push_timeout_s(
                self.timeout_s, self._slots.arena_bytes, self._world - 1, self.min_gbps))
        preposted, acked_foreign = header is None, False
        version = -1 if header is None else header.version
        try:
            if self._pg is None:
                raise SyncError(f"the group of epoch {e} was never built here")
            if header is not None:  # the slow path: the store said what comes; post the receives now
                if header.layout != self.layout_digest:
                    raise SyncError(f"layout mismatch: the sender pushes layout {header.layout}, this member "
                                    f"holds {self.layout_digest} (call use_layout on both sides at the same boundary)")
                check_cut(list(header.cut), self.buckets)
                self.chunks = list(header.cut)
                slot = self._slots.free(keep_staged, self._posted_slot())
                if slot is None:
                    raise SyncError("no free receive slot for the push")
                self._posted = self._post(e, k, self.chunks, self.arena(slot), slot)
            posted = self._posted
            slot = posted.slot
            got, t_bytes = self._transfer(posted, version, deadline)
            t_acked = time.perf_counter()
            self._posted = None
            if header is not None and got != version:
                raise SyncError(f"the acknowledgement carries version {got}, the store header said {version}")
            version = got
            wire = header.layout if header is not None else expect[3]
            if wire != self.layout_digest:  # pre-posted with the epoch's wire, but this member changed layout
                acked_foreign = True
                raise SyncError(f"layout mismatch: the sender pushes layout {wire}, this member holds "
                                f"{self.layout_digest} (call use_layout on both sides at the same boundary)")
        except Exception as exc:
            self._posted, self._expect = None, None
            self._report(e, k, exc)
            if acked_foreign:  # the sender thinks it delivered: join again, so that its next push rebuilds the
                self._leave(join_again=True)  # group and this member refuses that push before any byte
            what = f"version {version}" if version >= 0 else f"push {k} of epoch {e}"  # pre-posted: before the ack
            raise ReceiveError(f"member {self.me.id} failed to receive {what}: {exc}") from exc
        if header is None:
            self.chunks = expect[1]
        self._expect = (e, self.chunks, self.arena(slot), self.layout_digest)
        self._slots.staged_into(slot, version)
        return Staged(version, e, k, slot, {"sync/wait_header_s": t_header - t0, "sync/preposted": float(preposted),
                                      "sync/transfer_s": t_acked - t_header, "sync/ack_s": t_acked - t_bytes})

    def prepost(self, keep_staged: bool = False) -> bool:
        """Post the receives of this epoch's next push now, if that is possible (gloo, and this member received
        the epoch's last push); True if they are posted. :meth:`fetch` does it first thing; calling it earlier
        (after :meth:`apply`, say) means the sender never waits for this member to post. Receives left posted
        for longer than the group's timeout fail; the next fetch then joins again (see the protocol)."""
        if self._posted is None:
            expect = self._expect
            if (self._pg is None or not expect or expect[0] != self.epoch or not expect[1]
                    or self.backend not in P.PREPOSTS):
                return False
            slot = self._slots.free(keep_staged, None)
            if slot is None:
                return False
            # the epoch's wire; into the last push's buffer if this member changed its layout since (that
            # push is then refused once acknowledged)
            arena = self.arena(slot) if expect[3] == self.layout_digest else expect[2]
            self._posted = self._post(self.epoch, self._k, expect[1], arena, slot)
        return True

    def _post(self, e: int, k: int, chunks: list[tuple[int, int]], arena: torch.Tensor, slot: int) -> Posted:
        """Post the receives of every chunk of push k of epoch e into ``arena`` (slot ``slot``), on the group."""
        works = [self.transport.broadcast(self._pg, arena[start:end]) for start, end in chunks]
        self._works = works
        return Posted(e, k, works, slot)

    def _abort(self, e: int, k: int) -> Callable[[], str | None]:
        aborted = P.abort_key(e, k)

        def abort() -> str | None:
            if self._cancelled.is_set():
                return "this receiver was cancelled"
            return "the sender aborted this push" if self.store.check([aborted]) else None

        return abort

    def apply(self, staged: Staged, load: Load, per_bucket: bool = False) -> Received:
        """Hand the staged version to ``load`` (an iterator of (name, tensor), or with ``per_bucket`` one
        list of them per bucket, for a sink that copies a bucket in one fused call), then record it live.

        Loading starts only once every byte has arrived, so a push that fails half-way never leaves a
        half-loaded engine (vLLM's layerwise reload cannot be interrupted cleanly). A failing ``load`` is
        reported under the live key and raised as :class:`ReceiveError`; this member stays in the group
        and its next version overwrites every tensor.
        """
        t0 = time.perf_counter()
        with self._slots.applying(staged.slot, staged.version):  # never a slot that does not hold that version
            return self._load(staged, load, per_bucket, t0)

    def claim(self, staged: Staged) -> None:
        """Reserve ``staged``'s slot for :meth:`apply` now (no receive goes into it meanwhile); raises
        :class:`SyncError` if that slot no longer holds its version. :meth:`apply` releases it."""
        self._slots.claim(staged.slot, staged.version)

    def _load(self, staged: Staged, load: Load, per_bucket: bool, t0: float) -> Received:
        e, k = staged.epoch, staged.k
        it = self._slots.weights(staged.slot, per_bucket)
        try:
            load(it)
            if next(it, None) is not None:
                raise SyncError("load() returned before consuming every pushed tensor")
        except Exception as exc:
            msg = f"error: {type(exc).__name__}: {exc}"[:500]
            log.error("member %s could not load version %d: %s", self.me.id, staged.version, msg)
            with contextlib.suppress(Exception):  # the sender may be gone; the original error matters
                self.store.set(P.live_key(e, k, self.me.id), msg)
            raise ReceiveError(f"member {self.me.id} failed to load version {staged.version}: {exc}") from exc
        self.store.set(P.live_key(e, k, self.me.id), repr(time.time()))
        self.version = staged.version
        load_s = time.perf_counter() - t0
        return Received(staged.version, e, {**staged.metrics, "sync/load_s": load_s, "sync/pause_s": load_s})

    def receive(self, load: Load, timeout_s: float | None = None, per_bucket: bool = False) -> Received:
        """:meth:`fetch` then :meth:`apply`, for a caller that stands still meanwhile (``sync/pause_s`` is
        then all of it: header wait, transfer and load)."""
        t0 = time.perf_counter()
        got = self.apply(self.fetch(timeout_s), load, per_bucket)
        got.metrics["sync/pause_s"] = time.perf_counter() - t0
        return got

    def _transfer(self, posted: Posted, version: int, deadline: float) -> tuple[int, float]:
        """Wait for every chunk (already posted), then acknowledge: the allreduce to which this member brings
        0 and the sender the version, so it returns the version of the push (and when every chunk was here).

        Not posted with the receives, though that would spare the sender this thread's wake-up: on groups that
        run their ops in order (one gloo worker thread, so the ack cannot run before the bytes are here) it made
        the quiet push at 8 + 8 28 ms against 9.7 posted here (raw 6.9-7.9; bench/scale.py, 2026-12-07)."""
        e, k = posted.epoch, posted.k
        abort = self._abort(e, k)
        what = f"version {version}" if version >= 0 else f"push {k} of epoch {e}"
        works = posted.works
        for c in last_first(len(works)):
            self.transport.wait(works[c], deadline, f"chunk {c} of {what}", abort, self.slice_s)
        t_bytes = time.perf_counter()  # every chunk here: the acknowledgement takes the rest
        # the acknowledgement (see Sender.push). The collective needs every member, so if it fails, another
        # one did (this one's bytes are all here): a victim's report
        ack = self.transport.int64s([0])
        self._works.append(self.transport.allreduce(self._pg, ack))
        try:
            self.transport.wait(self._works[-1], deadline, f"the acknowledgement of {what}", abort, self.slice_s)
        except Aborted:
            raise
        except SyncError as exc:
            raise Aborted(f"the acknowledgement of {what} aborted: another member failed ({exc})") from exc
        return self.transport.read_int(ack), t_bytes

    def _report(self, e: int, k: int, exc: Exception) -> None:
        victim = caused_by(exc, Aborted)  # load() (vLLM) may wrap what our iterator raised
        msg = f"{P.ABORTED if victim else 'error'}: {type(exc).__name__}: {exc}"[:500]
        log.error("member %s, push %d of epoch %d: %s", self.me.id, k, e, msg)
        try:
            self.store.set(P.ack_key(e, k, self.me.id), msg)
            if not victim:
                self.store.add(P.failed_key(e, k), 1)
        except Exception:  # the sender may be gone; the original error is what matters
            log.exception("could not report the failure to the sender")

    def __del__(self) -> None:
        # a group with ops still pending must not be destroyed here (that blocks until they time out): retire
        # keeps it until they end (or for good, at exit)
        with contextlib.suppress(Exception):
            self.transport.retire(self._pg, self._works)

    def close(self) -> None:
        self.transport.retire(self._pg, self._works)
        self._pg = None
