"""Sender side of the weight push (learner rank 0). Mirrors :mod:`async_rlhf.sync.receiver`.

The sender hosts the store, decides membership (members change only at a version boundary, i.e. at
the start of a push), and pushes versions. The protocol is drawn in :mod:`async_rlhf.sync.protocol`.

Data path of one push, per bucket i (a bucket is a byte range; see :mod:`async_rlhf.sync.layout`)::

    its tensors lie back to back in one  -> broadcast that storage range (no copy): a lone contiguous
    storage (or it holds one tensor)        tensor, or parameters kept flat (``flatten_params``)
    otherwise                            -> wait until slot i % depth is free, copy the tensors into it
                                            (one fused copy), post its broadcast without waiting
    ...                                     packing bucket i + 1 overlaps the transfer of bucket i
    wait for every broadcast, then for every member's ack, all bounded by one deadline

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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from async_rlhf.sync import protocol as P
from async_rlhf.sync.group import (
    SyncError,
    SyncTimeout,
    build_pg,
    host_store,
    left,
    post_broadcast,
    retire,
    store_wait,
    wait_work,
)
from async_rlhf.sync.layout import Bucket, layout_digest
from async_rlhf.sync.tensors import TORCH_DTYPES, adjacent_bytes, aligned, as_bytes, dtype_name

__all__ = ["PushError", "Sender", "TORCH_DTYPES", "dtype_name"]

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _Plan:
    """How one bucket leaves the sender: straight from the parameter, or packed into a ring slot."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    nbytes: int
    slot: int | None  # None: a lone tensor, sent from its own storage (made contiguous if it is not)


class Sender:
    """Learner rank 0's end of the push group. Not thread-safe: call from one thread."""

    def __init__(self, buckets: list[Bucket], host: str = "127.0.0.1", port: int = 0, backend: str = "gloo",
                 timeout_s: float = 120.0, pipeline_depth: int = 2, slice_s: float = 0.2) -> None:
        if pipeline_depth < 1:
            raise ValueError("pipeline_depth must be at least 1")
        self.backend, self.timeout_s, self.depth, self.slice_s = backend, timeout_s, pipeline_depth, slice_s
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
        self.use_layout(buckets)

    # -- membership ---------------------------------------------------------------------------------
    @property
    def members(self) -> list[str]:
        return [m.id for m in self._members]

    @property
    def pg(self) -> dist.ProcessGroup | None:
        """The current epoch's group (rank 0 here); the benchmark uses it for its raw broadcast."""
        return self._pg

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

    def _take_joiners(self) -> None:
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
        retire(self._pg, self._works)
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
            self._pg = build_pg(dist.PrefixStore(P.pg_prefix(e), self.store), 0, len(members) + 1,
                                self.backend, self.timeout_s)
        except Exception as exc:
            raise PushError(version, e, [], {}, f"rendezvous of epoch {e} failed: {exc}") from exc
        self._broken = False

    # -- data path ----------------------------------------------------------------------------------
    def use_layout(self, buckets: list[Bucket]) -> None:
        """Set the bucket layout (receivers must use the same); reallocates the packing slots lazily."""
        plans, packed = [], 0
        for b in buckets:
            multi = len(b.entries) > 1
            plans.append(_Plan(tuple(e.name for e in b.entries), tuple(torch.Size(e.shape) for e in b.entries),
                               TORCH_DTYPES[b.dtype], b.nbytes, packed % self.depth if multi else None))
            packed += multi
        self.buckets, self._plans = buckets, plans
        self.layout_digest = layout_digest(buckets)
        self._slot_bytes = max([aligned(p.nbytes) for p in plans if p.slot is not None], default=0)
        self._slots: list[torch.Tensor] = []
        self._dst: dict[int, list[torch.Tensor]] = {}

    def _slot(self, slot: int) -> torch.Tensor:
        """Packing slot bytes (allocated on first use, reused by every push)."""
        while len(self._slots) <= slot:
            self._slots.append(torch.empty(self._slot_bytes, dtype=torch.uint8))
        return self._slots[slot]

    def _destinations(self, i: int) -> list[torch.Tensor]:
        """Typed views of bucket i's tensors in its slot (computed once per layout)."""
        if i not in self._dst:
            plan, b = self._plans[i], self.buckets[i]
            flat = self._slot(plan.slot)[:plan.nbytes].view(plan.dtype)
            self._dst[i] = [flat[e.offset:e.offset + e.numel].view(e.shape) for e in b.entries]
        return self._dst[i]

    def _sources(self, i: int, params: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Bucket i's tensors, checked against the layout (a cheap check: ~1 us per tensor)."""
        plan = self._plans[i]
        srcs = [params[name] for name in plan.names]
        for name, shape, t in zip(plan.names, plan.shapes, srcs):
            if t.shape != shape or t.dtype != plan.dtype:
                raise ValueError(f"parameter {name} is {tuple(t.shape)} {t.dtype}, the layout says {tuple(shape)} "
                                 f"{plan.dtype}: rebuild the layout")
        return srcs

    @torch.no_grad()
    def push(self, params: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Send ``version`` to every member; returns once all acknowledged it: each holds it whole and
        swaps it in at its next step boundary (:meth:`live_times` tells when it did).

        Raises :class:`PushError` naming the members that failed, within ``timeout_s``; the next push
        then opens a new epoch (call :meth:`drop` first to leave the failed members out).
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        self._take_joiners()
        rebuilt = bool(self._queued or self._dropped or self._broken)
        if rebuilt:
            self._rebuild(deadline, version)
        t_ready = time.perf_counter()
        metrics = {"sync/version": float(version), "sync/epoch": float(self.epoch),
                   "sync/members": float(len(self._members)), "sync/rebuild_s": t_ready - t0 if rebuilt else 0.0}
        if not self._members:
            self.version = version
            return {**metrics, "sync/bytes": 0.0, "sync/push_s": time.perf_counter() - t0,
                    "sync/acked_time": time.time()}
        e, k = self.epoch, self._k
        self._k += 1
        self.store.set(P.header_key(e, k), P.Header(version=version, layout=self.layout_digest).encode())
        failed = P.failed_key(e, k)

        def abort() -> str | None:
            return "a member reported a failure" if self.store.check([failed]) else None

        works: list[dist.Work] = []
        self._works = works
        slot_work: dict[int, dist.Work] = {}
        pack_s = 0.0
        try:
            for i, plan in enumerate(self._plans):
                srcs = self._sources(i, params)
                data = adjacent_bytes(srcs, self.buckets[i])  # back to back in one storage: as is
                packed = data is None and plan.slot is not None
                if data is None and plan.slot is None:
                    data = as_bytes(srcs[0].detach().contiguous())
                elif packed:
                    if plan.slot in slot_work:  # the slot's previous bucket must be on the wire first
                        wait_work(slot_work.pop(plan.slot), deadline, f"broadcast of version {version}", abort,
                                  self.slice_s)
                    tp = time.perf_counter()
                    torch._foreach_copy_(self._destinations(i), srcs)
                    pack_s += time.perf_counter() - tp
                    data = self._slot(plan.slot)[:plan.nbytes]
                works.append(post_broadcast(self._pg, data))
                if packed:
                    slot_work[plan.slot] = works[-1]
            for i, w in enumerate(works):
                wait_work(w, deadline, f"broadcast of bucket {i} of version {version}", abort, self.slice_s)
            t_sent = time.perf_counter()
            acks = self._await_acks(e, k, deadline)
        except SyncError as exc:
            self._fail(e, k, version, exc)
        except BaseException:  # e.g. a layout mismatch: receivers must not wait for the rest
            self._broken = True
            self.store.set(P.abort_key(e, k), "the sender failed")
            raise
        if any(v != "ok" for v in acks.values()):
            self._fail(e, k, version, SyncError("a member reported a failure"), known=acks)
        self.version = version
        self._last = (e, k, [m.id for m in self._members])
        t_done = time.perf_counter()
        nbytes = float(sum(b.nbytes for b in self.buckets))
        return {**metrics, "sync/bytes": nbytes, "sync/pack_s": pack_s, "sync/broadcast_s": t_sent - t_ready,
                "sync/ack_wait_s": t_done - t_sent, "sync/push_s": t_done - t0,
                "sync/gbps": nbytes / max(t_done - t_ready, 1e-9) / 1e9, "sync/acked_time": time.time()}

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

    def _await_acks(self, e: int, k: int, deadline: float) -> dict[str, str]:
        keys = {m.id: P.ack_key(e, k, m.id) for m in self._members}
        store_wait(self.store, list(keys.values()), deadline, "acknowledgements")
        values = self.store.multi_get(list(keys.values()))
        return {m: v.decode() for m, v in zip(keys, values)}

    def _fail(self, e: int, k: int, version: int, cause: Exception, known: dict[str, str] | None = None) -> None:
        """Tell receivers to give up, collect who reported what, raise :class:`PushError`."""
        self._broken = True
        self.store.set(P.abort_key(e, k), str(cause)[:200])
        known = dict(known or {})
        # live receivers notice the abort within a slice and report; a dead or hung one never does
        report_by = time.monotonic() + 5 * self.slice_s + 0.5
        for m in self._members:
            key = P.ack_key(e, k, m.id)
            if m.id in known:
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

    def close(self) -> None:
        retire(self._pg, self._works)
        self._pg = None
