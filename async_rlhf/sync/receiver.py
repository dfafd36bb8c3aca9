"""Receiver side of the weight push (inside a generator's vLLM worker). Mirrors the sender.

The receiver owns one byte buffer holding every bucket (allocated on the first push, reused by every
later one). A push posts the receive of every bucket at once, then hands the named tensors to ``load``
bucket by bucket as they arrive, so loading bucket i overlaps the transfer of bucket i + 1::

    wait(hdr k) -> post recv(bucket 0..B-1) -> load(  wait(bucket 0), yield its tensors,
                                                      wait(bucket 1), yield its tensors, ...  ) -> ack

``load`` receives an iterator of (name, tensor) and must consume it: vLLM's
``model_runner.reload_weights(weights_iterator=...)`` does, and so does a plain copy loop. The tensors are
views into the buffer: valid until the next push, so ``load`` must copy them (both of those do), and the
buffer is kept whole (not a ring) because vLLM's layerwise reload holds a layer's tensors until the
layer is complete, which may be several buckets later.

Usage in a generator's worker::

    rx = Receiver(buckets, "gen1", host, port, timeout_s=120)
    rx.join()                      # initial member: returns once the sender forms the group
    ...
    got = rx.receive(load)         # at each update (a late joiner calls this first: it joins at the
                                   # next version boundary and gets that version before serving)
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from async_rlhf.sync import protocol as P
from async_rlhf.sync.group import (
    Aborted,
    SyncError,
    allreduce_sum,
    broadcast,
    build_pg,
    connect_store,
    left,
    post_broadcast,
    retire,
    store_wait,
    wait_work,
)
from async_rlhf.sync.layout import Bucket, layout_digest
from async_rlhf.sync.tensors import TORCH_DTYPES, arena_offsets, named_views

log = logging.getLogger(__name__)

Load = Callable[[Iterator], object]
"""Consumes an iterator of (name, tensor), or of lists of them (one per bucket) with ``per_bucket``."""


class Excluded(SyncError):
    """This member was dropped from the push group (it missed a deadline, or a restarted process took
    over its id). The next ``join`` or ``receive`` asks to join again, as a new incarnation."""


class ReceiveError(SyncError):
    """This member failed to receive or load a pushed version (the sender was told)."""


@dataclass(frozen=True)
class Received:
    version: int
    epoch: int
    metrics: dict[str, float]


class Receiver:
    """A generator's end of the push group. Not thread-safe: call from one thread (the engine loop)."""

    def __init__(self, buckets: list[Bucket], member_id: str, host: str, port: int, backend: str = "gloo",
                 timeout_s: float = 120.0, slice_s: float = 0.2) -> None:
        self.me = P.Member(member_id, "")
        P.decode_join(P.encode_join(self.me))  # validates the id (join() draws the nonce)
        self.backend, self.timeout_s, self.slice_s = backend, timeout_s, slice_s
        self.store = connect_store(host, port, timeout_s)
        self.epoch: int | None = None
        self.version: int | None = None
        self._k = 0
        self._pg: dist.ProcessGroup | None = None
        self._works: list[dist.Work] = []
        self._queued = False
        self.use_layout(buckets)

    @property
    def member_id(self) -> str:
        return self.me.id

    @property
    def pg(self) -> dist.ProcessGroup | None:
        """The current epoch's group; the benchmark uses it for its raw broadcast."""
        return self._pg

    def use_layout(self, buckets: list[Bucket]) -> None:
        """Set the bucket layout (the sender's); the buffer is allocated on the next receive."""
        self.buckets = buckets
        self.layout_digest = layout_digest(buckets)
        self._offsets, self._arena_bytes = arena_offsets(buckets)
        self._arena: torch.Tensor | None = None
        self._views: list[list[tuple[str, torch.Tensor]]] = []

    def arena(self) -> torch.Tensor:
        """The byte buffer holding every bucket (the benchmark also receives its raw broadcast into it)."""
        if self._arena is None:
            self._arena = torch.empty(self._arena_bytes, dtype=torch.uint8)
            self._views = [named_views(self._bucket_bytes(i), b) for i, b in enumerate(self.buckets)]
        return self._arena

    def _bucket_bytes(self, i: int) -> torch.Tensor:
        off = self._offsets[i]
        return self.arena()[off:off + self.buckets[i].nbytes]

    # -- membership ---------------------------------------------------------------------------------
    def join(self, timeout_s: float | None = None) -> int:
        """Ask to join and wait until the sender admits this member (at ``form`` or at its next push);
        returns the epoch. A joiner must then call :meth:`receive` promptly: the push that admitted it
        is already on its way."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        if not self._queued:
            # every request is a new incarnation: its admission key cannot be confused with an old one
            self.me = P.Member(self.me.id, uuid.uuid4().hex[:12])
            self.store.queue_push(P.JOIN_QUEUE, P.encode_join(self.me))
            self._queued = True
        key = P.admit_key(self.me)
        store_wait(self.store, [key], deadline, f"admission of {self.me.id} to the push group (is the sender pushing?)")
        self._queued = False
        epoch = int(P.decode(self.store.get(key))["epoch"])
        self._enter(epoch, deadline)
        return epoch

    def _enter(self, epoch: int, deadline: float) -> None:
        store_wait(self.store, [P.members_key(epoch)], deadline, f"the member list of epoch {epoch}")
        members = P.decode_members(self.store.get(P.members_key(epoch)))
        retire(self._pg, self._works)
        self._pg, self._works, self.epoch, self._k = None, [], None, 0
        if self.me not in members:
            raise Excluded(f"member {self.me.id} was dropped from the push group at epoch {epoch}; "
                           "join again to come back")
        self.epoch = epoch
        rank = members.index(self.me) + 1
        self.store.set(P.ready_key(epoch, self.me.id), self.me.nonce)
        store_wait(self.store, [P.go_key(epoch)], deadline, f"the sender to open epoch {epoch}")
        self._pg = build_pg(dist.PrefixStore(P.pg_prefix(epoch), self.store), rank, len(members) + 1,
                            self.backend, self.timeout_s)
        log.info("member %s entered push group epoch %d as rank %d of %d", self.me.id, epoch, rank,
                 len(members) + 1)

    # -- data path ----------------------------------------------------------------------------------
    def receive(self, load: Load, timeout_s: float | None = None, per_bucket: bool = False) -> Received:
        """Wait for the next push addressed to this member, load it through ``load``, acknowledge it.

        ``load`` gets an iterator of (name, tensor), or with ``per_bucket`` one list of them per bucket
        (for a sink that copies a bucket in one fused call). Follows epoch changes on the way (and joins
        first if this member is not in the group yet).
        Raises :class:`Excluded` if the sender dropped this member, :class:`ReceiveError` if this push
        failed here (the sender was told), :class:`SyncTimeout` if no push came within ``timeout_s``.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        if self.epoch is None:
            self.join(left(deadline))
        while True:
            e, k = self.epoch, self._k
            store_wait(self.store, [P.header_key(e, k)], deadline, f"push {k} of epoch {e} (is the sender pushing?)")
            header = P.Header.decode(self.store.get(P.header_key(e, k)))
            self._k += 1
            if header.next_epoch is None:
                break
            self._enter(header.next_epoch, deadline)
        version = header.version
        t_header = time.perf_counter()
        marks: dict[str, float] = {}
        try:
            if self._pg is None:
                raise SyncError(f"the group of epoch {e} was never built here")
            if header.layout != self.layout_digest:
                raise SyncError(f"layout mismatch: the sender pushes layout {header.layout}, this member holds "
                                f"{self.layout_digest} (call use_layout on both sides at the same boundary)")
            self._transfer(load, per_bucket, version, e, k, deadline, marks)
        except Exception as exc:
            self._report(e, k, exc)
            raise ReceiveError(f"member {self.me.id} failed to receive version {version}: {exc}") from exc
        self.store.set(P.ack_key(e, k, self.me.id), "ok")
        t_ack = time.perf_counter()
        self.version = version
        return Received(version, e, {
            "sync/wait_header_s": t_header - t0,
            "sync/transfer_s": marks["last_bucket"] - t_header,
            "sync/load_tail_s": marks["loaded"] - marks["last_bucket"],
            "sync/pause_s": t_ack - t0,
        })

    def _transfer(self, load: Load, per_bucket: bool, version: int, e: int, k: int, deadline: float,
                  marks: dict[str, float]) -> None:
        aborted = P.abort_key(e, k)

        def abort() -> str | None:
            return "the sender aborted this push" if self.store.check([aborted]) else None

        self.arena()
        works = [post_broadcast(self._pg, self._bucket_bytes(i)) for i in range(len(self.buckets))]
        self._works = works
        consumed = [0]

        def stream() -> Iterator:
            for i, w in enumerate(works):
                wait_work(w, deadline, f"bucket {i} of version {version}", abort, self.slice_s)
                consumed[0] = i + 1
                if i == len(works) - 1:
                    marks["last_bucket"] = time.perf_counter()
                if per_bucket:
                    yield self._views[i]
                else:
                    yield from self._views[i]

        it = stream()
        load(it)
        if consumed[0] < len(works) or next(it, None) is not None:
            for _ in it:  # let the sender finish before reporting
                pass
            raise SyncError("load() returned before consuming every pushed tensor")
        marks.setdefault("last_bucket", time.perf_counter())
        marks["loaded"] = time.perf_counter()

    def _report(self, e: int, k: int, exc: Exception) -> None:
        victim = _caused_by(exc, Aborted)  # load() (vLLM) may wrap what our iterator raised
        msg = f"{P.ABORTED if victim else 'error'}: {type(exc).__name__}: {exc}"[:500]
        log.error("member %s, push %d of epoch %d: %s", self.me.id, k, e, msg)
        try:
            self.store.set(P.ack_key(e, k, self.me.id), msg)
            if not victim:
                self.store.add(P.failed_key(e, k), 1)
        except Exception:  # the sender may be gone; the original error is what matters
            log.exception("could not report the failure to the sender")

    def close(self) -> None:
        retire(self._pg, self._works)
        self._pg = None


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


# -- the first, rank-based API (the generator's worker extension still calls it) ----------------------

def receive_buckets(pg, buckets: list[Bucket], timeout_s: float) -> list[tuple[str, torch.Tensor]]:
    """Receive every bucket from rank 0 and return named views into the flat buffers."""
    named: list[tuple[str, torch.Tensor]] = []
    for b in buckets:
        flat = torch.empty(b.numel, dtype=TORCH_DTYPES[b.dtype])
        broadcast(pg, flat, root=0, timeout_s=timeout_s)
        named.extend((e.name, flat[e.offset:e.offset + e.numel].view(e.shape)) for e in b.entries)
    return named


def acknowledge(pg, timeout_s: float) -> None:
    """Tell the sender this receiver has loaded the version (the sender sums the acks)."""
    allreduce_sum(pg, torch.ones(1, dtype=torch.int64), timeout_s)
