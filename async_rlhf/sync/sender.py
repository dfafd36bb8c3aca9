"""Sender side of the weight push (learner rank 0). Mirrors :mod:`async_rlhf.sync.receiver`.

The sender hosts the store, decides membership (members change only at a version boundary, i.e. at
the start of a push), and pushes versions. The protocol is drawn in :mod:`async_rlhf.sync.protocol`.

Data path of one push, per chunk c of its cut (a byte range of the arena, one broadcast; the cut is one
chunk when the parameters are kept flat, else large tensors alone and small ones packed: see
:mod:`async_rlhf.sync.tensors`; the cut and the packing are :mod:`async_rlhf.sync.send_staging`'s)::

    its pieces lie in parameter memory  -> broadcast that storage range (no copy): a part of one
    where the chunk puts them              contiguous tensor, or parameters kept flat (``flatten_params``)
    otherwise                           -> wait until slot c % depth is free, copy the pieces into it
                                           (one fused copy), post its broadcast without waiting
    ...                                    packing chunk c + 1 overlaps the transfer of chunk c
    wait for every broadcast, then the ack (one allreduce of versions), all bounded by one deadline

Usage on learner rank 0::

    sender = Sender(buckets, host, port, timeout_s=120)
    sender.form(["gen0", "gen1"])              # the initial members (they already hold version 0)
    try:
        sender.push(params, version)           # joiners queued since the last push are admitted first
    except PushError as err:                   # names who failed; the group must be rebuilt
        sender.drop(err.failed_members)
        sender.push(params, version)           # opens a new epoch without them, pushes again
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from async_rlhf.sync import protocol as P
from async_rlhf.sync.group import (
    SyncError,
    SyncTimeout,
    connect_store,
    host_store,
    last_first,
    left,
    push_timeout_s,
    store_wait,
    track,
)
from async_rlhf.sync.layout import Bucket
from async_rlhf.sync.send_staging import OWN_BYTES, SendStaging, Streamed
from async_rlhf.sync.tensors import TORCH_DTYPES, dtype_name, layout_digest
from async_rlhf.sync.transport import Transport, make_transport

__all__ = ["OWN_BYTES", "PushError", "Sender", "Streamed", "TORCH_DTYPES", "dtype_name"]

log = logging.getLogger(__name__)

JOIN_POLL_S = 0.02
"""How often the sender looks for join requests (on its own thread and store connection)."""


class PushError(SyncError):
    """A push (or the group rebuild before it) failed; says which members are to blame.

    ``missing``: members that neither acknowledged nor reported in time (dead or hung).
    ``errors``: members that reported a failure of their own, with their message.
    ``aborted``: members that only gave up because the sender aborted (healthy; keep them).
    """

    def __init__(self, version: int, epoch: int, missing: Sequence[str], errors: Mapping[str, str], cause: str,
                 aborted: Sequence[str] = ()) -> None:
        self.version, self.epoch = version, epoch
        self.missing, self.errors, self.aborted = list(missing), dict(errors), list(aborted)
        parts = []
        if self.missing:
            parts.append(f"no acknowledgement from {', '.join(self.missing)}")
        parts += [f"{m} reported {msg}" for m, msg in self.errors.items()]
        super().__init__(f"weight push of version {version} failed (epoch {epoch}): "
                         f"{'; '.join(parts) or 'no member to blame'} [{cause}]")

    @property
    def failed_members(self) -> list[str]:
        """The members to :meth:`Sender.drop` before pushing again."""
        return self.missing + [m for m in self.errors if m not in self.missing]


def _watch_joins(store: dist.TCPStore, seen: threading.Event, stop: threading.Event) -> None:
    """Looks for join requests off the push's critical path (a store round trip costs as much as a 1 MB
    transfer), so that :meth:`Sender.push` only takes them when there are some."""
    while not stop.wait(JOIN_POLL_S):
        try:
            if store.queue_len(P.JOIN_QUEUE):
                seen.set()
        except Exception:  # the store went away with the sender
            return


class Sender:
    """Learner rank 0's end of the push group. Not thread-safe: call from one thread."""

    def __init__(self, buckets: list[Bucket], host: str = "127.0.0.1", port: int = 0, backend: str | Transport = "gloo",
                 timeout_s: float = 120.0, pipeline_depth: int = 2, slice_s: float = 0.2,
                 chunk_bytes: int | None = None, own_bytes: int = OWN_BYTES, min_gbps: float = 0.0) -> None:
        """``chunk_bytes``: size of one broadcast. By default a push whose bytes all lie in parameter memory
        (parameters kept flat) is one broadcast, as a raw one; otherwise :func:`auto_chunk_bytes` (packing
        one chunk overlaps the transfer of the one before), and a tensor of ``own_bytes`` or more is a
        broadcast of its own, sent from its storage (see :func:`cut_arena`). Members learn the cut from the
        push header. ``backend``: ``sync.backend`` or a :class:`Transport`; parameters on another device than
        the transport's are staged through its packing slots (bounded: ``pipeline_depth`` chunks). ``min_gbps``:
        each push may take ``timeout_s`` plus its bytes to every member at this rate (:func:`push_timeout_s`)."""
        if pipeline_depth < 1:
            raise ValueError("pipeline_depth must be at least 1")
        self.transport = backend if isinstance(backend, Transport) else make_transport(backend)
        backend = self.transport.name
        self.backend, self.timeout_s, self.depth, self.slice_s = backend, timeout_s, pipeline_depth, slice_s
        self.chunk_bytes, self.own_bytes, self.min_gbps = chunk_bytes, own_bytes, min_gbps
        self.store = host_store(host, port, timeout_s)
        self.host, self.port = host, self.store.port
        self.epoch = -1
        self.version: int | None = None
        self._members: list[P.Member] = []
        self._k = 0  # headers written in the current epoch
        self._pg: dist.ProcessGroup | None = None
        self._broken = False
        self._dropped: set[str] = set()
        self._queued: list[P.Member] = []
        self._works: list[dist.Work] = []
        self._last: tuple[int, int, list[str]] | None = None  # epoch, k and members of the last push
        self._reported_dead: frozenset[str] = frozenset()  # members someone outside saw die (fail_members)
        self.use_layout(buckets)
        track(self)
        self._joins_seen = threading.Event()
        self._watcher_stop = threading.Event()
        self._watcher = threading.Thread(  # holds no reference to the sender: it must not keep it alive
            target=_watch_joins, args=(connect_store(host, self.port, timeout_s), self._joins_seen, self._watcher_stop),
            name="push-join-watcher", daemon=True)
        self._watcher.start()
        weakref.finalize(self, self._watcher_stop.set)  # also at exit: stop polling before the store goes

    # -- membership ---------------------------------------------------------------------------------
    @property
    def members(self) -> list[str]:
        return [m.id for m in self._members]

    def form(self, member_ids: Sequence[str], timeout_s: float | None = None) -> None:
        """Open the first epoch once every id in ``member_ids`` has asked to join (no push: they start
        from the same checkpoint as the learner). Joiners beyond these are admitted too."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        want = set(member_ids)
        while not want <= {m.id for m in self._queued}:
            self._take_joiners()
            if want <= {m.id for m in self._queued}:
                break
            if left(deadline) <= 0:
                absent = sorted(want - {m.id for m in self._queued})
                raise PushError(-1, self.epoch + 1, absent, {}, "never asked to join the push group")
            time.sleep(0.01)
        order = {m: i for i, m in enumerate(member_ids)}  # ranks follow the given order
        self._queued.sort(key=lambda m: order.get(m.id, len(order)))
        self._rebuild(deadline, version=-1)

    def drop(self, member_ids: Sequence[str]) -> None:
        """Remove members at the next push (the version boundary); unknown ids are ignored."""
        self._dropped |= set(member_ids) & set(self.members)

    def fail_members(self, member_ids: Sequence[str]) -> None:
        """Members known dead (the driver saw their process end): a push in flight aborts within a slice
        instead of waiting ``timeout_s`` for their acknowledgement, and the next push leaves them out. Safe
        to call from any thread (one atomic assignment)."""
        self._reported_dead = self._reported_dead | frozenset(member_ids)

    def _take_joiners(self) -> None:
        self._joins_seen.clear()
        n = self.store.queue_len(P.JOIN_QUEUE)
        for _ in range(n):
            raw = self.store.queue_pop(P.JOIN_QUEUE, False)
            try:
                member = P.decode_join(raw)
            except ValueError as exc:
                log.error("ignoring a malformed join request: %s", exc)
                continue
            self._queued = [m for m in self._queued if m.id != member.id] + [member]
            log.info("member %s asked to join the push group", member.id)

    def _rebuild(self, deadline: float, version: int) -> None:
        """Open epoch e + 1 with the current members minus dropped ones plus queued joiners."""
        joiners, self._queued = self._queued, []
        members = P.merge_members(self._members, self._dropped, joiners)
        old_epoch, e = self.epoch, self.epoch + 1
        self.store.set(P.members_key(e), P.encode_members(members))
        if old_epoch >= 0:
            self.store.set(P.header_key(old_epoch, self._k), P.Header(next_epoch=e).encode())
        for j in joiners:
            self.store.set(P.admit_key(j), P.encode({"epoch": e}))
        self.transport.retire(self._pg, self._works)
        gone = [m.id for m in self._members if m not in members]
        self._pg, self._works, self._dropped = None, [], set()
        self.epoch, self._k, self._members, self._broken = e, 0, members, True
        log.info("push group epoch %d: members %s (joined %s, left %s)", e, self.members,
                 [j.id for j in joiners], gone)
        if not members:
            self._broken = False
            return
        ready = {m.id: P.ready_key(e, m.id) for m in members}
        try:
            store_wait(self.store, list(ready.values()), deadline, f"members of epoch {e} to get ready")
        except SyncTimeout as exc:
            missing = [m for m, key in ready.items() if not self.store.check([key])]
            raise PushError(version, e, missing, {}, "did not enter the rebuilt group in time") from exc
        self.store.set(P.go_key(e), "1")
        try:
            self._pg = self.transport.open(dist.PrefixStore(P.pg_prefix(e), self.store), 0, len(members) + 1,
                                           self.timeout_s, ["the sender", *(m.id for m in members)])
        except Exception as exc:  # a bounded rendezvous names the ranks that never came
            missing = [members[r - 1].id for r in getattr(exc, "ranks", ()) if r > 0]
            raise PushError(version, e, missing, {}, f"rendezvous of epoch {e} failed: {exc}") from exc
        self._broken = False

    # -- data path ----------------------------------------------------------------------------------
    def use_layout(self, buckets: list[Bucket]) -> None:
        """Set the bucket layout (receivers must use the same): a new :class:`SendStaging` (its packing slots
        are allocated lazily), with the current ``chunk_bytes`` and ``own_bytes``.

        A change of layout opens a new epoch at the next push: members pre-post their receives for the wire of
        the epoch's last push, so the wire must not change under them within an epoch."""
        digest = layout_digest(buckets)
        if self._pg is not None and digest != getattr(self, "layout_digest", digest):
            self._broken = True
        self.buckets = buckets
        self.layout_digest = digest
        self._staging = SendStaging(buckets, self.transport, self.depth, self.chunk_bytes, self.own_bytes)

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """The current cut: the byte ranges of the arena sent as one broadcast each (the last push's, or the
        layout's packed cut before any)."""
        return self._staging.chunks

    @torch.no_grad()
    def push(self, params: Mapping[str, torch.Tensor], version: int,
             stream: Streamed | None = None) -> dict[str, float]:
        """Send ``version`` to every member; returns once all acknowledged it: each holds it whole and
        swaps it in at its next step boundary (:meth:`live_times` tells when it did). ``stream``: the
        parameters are gathered window by window as the chunks are packed (ZeRO-3).

        Raises :class:`PushError` naming the members that failed, within ``timeout_s``; the next push
        then opens a new epoch (call :meth:`drop` first to leave the failed members out).
        """
        t0 = time.perf_counter()
        receivers = len(self._members) + len(self._queued)
        staging = self._staging
        deadline = time.monotonic() + push_timeout_s(self.timeout_s, staging.nbytes, receivers, self.min_gbps)
        # a layout mismatch raises here, before anything is announced
        before = staging.chunks
        tensors, sources = staging.sources(params) if stream is None else staging.streamed(params, stream)
        if staging.chunks != before and self._k > 0:  # members pre-posted for the old cut: a new epoch
            self._broken = True
        dead, self._reported_dead = self._reported_dead, frozenset()
        self.drop(list(dead))
        if self._joins_seen.is_set():
            self._take_joiners()
        rebuilt = bool(self._queued or self._dropped or self._broken)
        if rebuilt:
            self._rebuild(deadline, version)
        t_ready = time.perf_counter()
        if not self._members:
            self.version = version
            return {**self._metrics(version, rebuilt, t0, t_ready), "sync/bytes": 0.0,
                    "sync/push_s": time.perf_counter() - t0, "sync/acked_time": time.time()}
        e, k = self.epoch, self._k
        self._k += 1
        # the store header is for members that are not pre-posted, which happens only at an epoch's first push
        # (every member acknowledged the previous push of this epoch, so each one's receives wait for this one)
        # and under NCCL (see protocol.PREPOSTS). Nothing else is done before the first chunk is on its way:
        # on a loaded machine every line of Python here costs several times its quiet figure
        announced = k > 0 and bool(self.chunks) and self.backend in P.PREPOSTS

        def announce() -> None:
            header = P.Header(version=version, layout=self.layout_digest, cut=tuple(self.chunks))
            self.store.set(P.header_key(e, k), header.encode())

        ids = {m.id for m in self._members}

        def abort() -> str | None:
            dead = ids & self._reported_dead
            if dead:
                return f"{', '.join(sorted(dead))} died (seen by the driver)"
            return "a member reported a failure" if self.store.check([P.failed_key(e, k)]) else None

        works: list[dist.Work] = []
        self._works = works
        slot_work: dict[int, dist.Work] = {}
        pack_s = 0.0
        try:
            for c in range(len(staging.chunks)):
                data = sources[c]  # already where the chunk puts it: sent as is
                if data is None:
                    if stream is not None:
                        stream.before_chunk(c)
                    pieces = staging.pieces(c, tensors)
                    slot = staging.slot_of(c)
                    if slot in slot_work:  # the slot's previous chunk must be on the wire first
                        self.transport.wait(slot_work.pop(slot), deadline, f"broadcast of version {version}",
                                            abort, self.slice_s)
                    tp = time.perf_counter()
                    data = staging.pack(c, pieces)
                    pack_s += time.perf_counter() - tp
                    works.append(self.transport.broadcast(self._pg, data))
                    slot_work[slot] = works[-1]
                else:
                    works.append(self.transport.broadcast(self._pg, data))
                if not announced:  # its store round trip overlaps the first chunk
                    announce()
                    announced = True
            if not announced:  # a layout without bytes: no chunk to overlap
                announce()
                announced = True
            for c in last_first(len(works)):
                self.transport.wait(works[c], deadline, f"broadcast of chunk {c} of version {version}", abort,
                                    self.slice_s)
            t_sent = time.perf_counter()
            # the acknowledgement: a one-element allreduce on the group, in which every member, once it holds
            # every chunk, brings 0 and the sender the version (members pre-posted for this push learn from it
            # which version they hold: no header of its own, no store round trip; the wire is the epoch's); a
            # member that failed reports through the store. One element: gloo takes a slower path for more
            # (measured: +0.25 ms). Posted only once the broadcasts are out: posted right behind them it
            # shares the group's worker threads with the transfer (measured: 2.4 ms instead of 1.5 for 2 MB)
            ack = self.transport.int64s([version])
            works.append(self.transport.allreduce(self._pg, ack))
            self.transport.wait(works[-1], deadline, f"acknowledgements of version {version}", abort, self.slice_s)
            acked = self.transport.read_int(ack)
            if acked != version:
                raise SyncError(f"the acknowledgement of version {version} came back as {acked}")
        except SyncError as exc:
            if not announced:
                announce()
            self._fail(e, k, version, exc)
        except BaseException:  # e.g. an interrupt: receivers must not wait for the rest
            self._broken = True
            if not announced:
                announce()
            self.store.set(P.abort_key(e, k), "the sender failed")
            raise
        self.version = version
        self._last = (e, k, [m.id for m in self._members])
        t_done = time.perf_counter()
        return {**self._metrics(version, rebuilt, t0, t_ready), "sync/bytes": staging.nbytes, "sync/pack_s": pack_s,
                "sync/broadcast_s": t_sent - t_ready, "sync/ack_wait_s": t_done - t_sent, "sync/push_s": t_done - t0,
                "sync/gbps": staging.nbytes / max(t_done - t_ready, 1e-9) / 1e9, "sync/acked_time": time.time()}

    def _metrics(self, version: int, rebuilt: bool, t0: float, t_ready: float) -> dict[str, float]:
        return {"sync/version": float(version), "sync/epoch": float(self.epoch),
                "sync/members": float(len(self._members)), "sync/rebuild_s": t_ready - t0 if rebuilt else 0.0}

    def wait_live(self, timeout_s: float) -> dict[str, float | str]:
        """Wait until every member of the last push has swapped it in (or reported a load error), at most
        ``timeout_s``; returns :meth:`live_times` (a member still loading is absent, never blamed here)."""
        if self._last is not None:
            e, k, ids = self._last
            with contextlib.suppress(SyncTimeout):
                store_wait(self.store, [P.live_key(e, k, m) for m in ids], time.monotonic() + timeout_s,
                           "members to serve the pushed version")
        return self.live_times()

    def live_times(self) -> dict[str, float | str]:
        """For the last completed push: member -> wall time at which it started serving that version, or
        its "error: ..." if loading failed there; members that have not swapped it in yet are absent."""
        if self._last is None:
            return {}
        e, k, ids = self._last
        keys = {m: P.live_key(e, k, m) for m in ids}
        present = {m: key for m, key in keys.items() if self.store.check([key])}
        values = self.store.multi_get(list(present.values())) if present else []
        out: dict[str, float | str] = {}
        for m, raw in zip(present, values):
            text = raw.decode()
            out[m] = text if text.startswith("error") else float(text)
        return out

    def _fail(self, e: int, k: int, version: int, cause: Exception, known: dict[str, str] | None = None) -> None:
        """Tell receivers to give up, collect who reported what, raise :class:`PushError`."""
        self._broken = True
        self.store.set(P.abort_key(e, k), str(cause)[:200])
        known = dict(known or {})
        # live receivers notice the abort within a slice and report; a dead or hung one never does
        report_by = time.monotonic() + 5 * self.slice_s + 0.5
        for m in self._members:
            key = P.ack_key(e, k, m.id)
            if m.id in known or m.id in self._reported_dead:  # a dead member never reports
                continue
            try:
                store_wait(self.store, [key], report_by, "a report")
                known[m.id] = self.store.get(key).decode()
            except SyncTimeout:
                pass
        missing = [m.id for m in self._members if m.id not in known]
        aborted = [m for m, v in known.items() if v.startswith(P.ABORTED)]
        errors = {m: v for m, v in known.items() if v != "ok" and m not in aborted}
        err = PushError(version, e, missing, errors, f"{type(cause).__name__}: {cause}", aborted)
        log.error("%s", err)
        raise err from cause

    def __del__(self) -> None:
        # a group with ops still pending must not be destroyed here (that blocks until they time out): retire
        # keeps it until they end (or for good, at exit)
        with contextlib.suppress(Exception):
            self.transport.retire(self._pg, self._works)

    def close(self) -> None:
        self._watcher_stop.set()
        self.transport.retire(self._pg, self._works)
        self._pg = None
