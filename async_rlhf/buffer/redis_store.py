"""Redis Streams store: the buffer's state survives a SIGKILL of the service and a restart of Redis.

Key layout (``P`` is ``buffer.redis_prefix``; one buffer service writes one prefix)::

    P:stream   STREAM  one entry per held or delivered group   g=<group id> v=<min version> n=<samples>
                       |                                       t=<tokens>
                       '- consumer group "learners"; its pending-entry list (PEL) says who owns what:
                            consumer "_held"          -> held      (waiting for a learner)
                            consumer "_awaiting"      -> awaiting_reward (idle time = time since the put)
                            consumer "<learner name>" -> delivered (idle time = time since delivery)
    P:ids      HASH    group id -> stream entry id   (held or delivered; the idempotency index of put)
    P:data     HASH    group id -> the group's msgpack bytes (kept apart from the entry: a payload passed through
                       a Lua script is copied twice more, which halved throughput at 256 KB)
    P:deliv    HASH    group id -> "<learner version> <deliveries>"   (set at delivery, kept while held again)
    P:trained  SET     group ids acknowledged: never delivered again
    P:dropped  HASH    group id -> reason
    P:meta     HASH    admission (version, accepted, running) and service counters (c:put, c:trained, ...)
    P:admits   HASH    admit request id -> "granted version" (the last 4096 grants; a retried admit is answered
    P:admit_order LIST   from here after a restart too, never granted twice); the list keeps their order

Transitions, each ONE Lua script (atomic; with ``appendfsync always`` durable before the reply)::

    put        HSET P:data (the payloads, idempotent), then the script: per group XADD P:stream; XREADGROUP
               into "_held" or "_awaiting" (the entry enters the PEL); HSET P:ids; then HSET P:meta
               (both in one pipeline, one round trip; a batch of groups is one script)
    reward     HSET P:data (rewarded bytes), then the script: XADD a new entry; XREADGROUP it into "_held";
               XACK + XDEL the awaiting entry; HSET P:ids
    deliver    XCLAIM <ids> to <learner> JUSTID (idle -> 0); HSET P:deliv; HSET P:meta
    ack        XACK + XDEL; HDEL P:ids P:deliv P:data; SADD P:trained; HSET P:meta
    drop       XACK + XDEL; HDEL P:ids P:deliv P:data; HSET P:dropped; HSET P:meta
    redeliver  XCLAIM <ids> back to "_held" JUSTID; HSET P:meta

Recovery protocol (service start, e.g. after SIGKILL)::

    1. XGROUP CREATE P:stream learners 0 MKSTREAM      (BUSYGROUP: it exists, keep it)
    2. HGETALL P:meta, SMEMBERS P:trained, HGETALL P:dropped, HGETALL P:deliv
    3. XREADGROUP ... ">" into "_held" until empty     (adopts any entry no group read; none is expected)
    4. XRANGE P:stream (paged) for the payloads; XPENDING (paged) for owner and idle time:
         owner "_held" -> held; "_awaiting" -> awaiting_reward, put at now - idle;
         any other owner -> delivered to it, delivered at now - idle
    5. serve. A delivered group whose learner never acks is claimed back to "_held" once idle longer
       than buffer.visibility_timeout_s (or at once when its consumer is declared dead) and delivered again;
       an ack that arrives late still counts once (at-least-once delivery + idempotent ack).

Every script is idempotent (absolute counter values, set operations, XCLAIM), so a call whose reply was
lost when Redis died is simply retried once Redis is back (for up to ``buffer.redis_retry_s``); the
in-memory mirror the service decides with then agrees with what Redis replays from its append-only file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import redis

from async_rlhf.buffer.redis_scripts import ADMIT, DELIVER, FINISH, META, PUT, REWARD
from async_rlhf.buffer.run_scope import durability_warnings
from async_rlhf.buffer.store import Delivery, MemoryStore, StoredGroup
from async_rlhf.retry import retry

log = logging.getLogger(__name__)
T = TypeVar("T")

GROUP = "learners"
HELD_CONSUMER = "_held"
AWAITING_CONSUMER = "_awaiting"
RESERVED = (HELD_CONSUMER, AWAITING_CONSUMER)


_RETRYABLE = (redis.ConnectionError, redis.TimeoutError)


def _pairs(meta: Mapping[str, int] | None) -> list[Any]:
    out: list[Any] = []
    for k, v in (meta or {}).items():
        out += [k, int(v)]
    return out


class RedisStore(MemoryStore):
    """Durable store on Redis Streams; reads come from an in-memory mirror rebuilt at start."""

    durable = True
    name = "redis"

    def __init__(self, url: str, prefix: str = "async_rlhf:buffer", retry_s: float = 30.0,
                 client: redis.Redis | None = None) -> None:
        super().__init__()
        self.url, self.prefix, self.retry_s = url, prefix, retry_s
        self.r = client or redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=2)
        p = prefix
        self.k_stream, self.k_ids, self.k_deliv = f"{p}:stream", f"{p}:ids", f"{p}:deliv"
        self.k_trained, self.k_dropped, self.k_meta = f"{p}:trained", f"{p}:dropped", f"{p}:meta"
        self.k_admits, self.k_admit_order = f"{p}:admits", f"{p}:admit_order"
        self.k_data = f"{p}:data"
        self._put = self.r.register_script(PUT)
        self._reward = self.r.register_script(REWARD)
        self._deliver = self.r.register_script(DELIVER)
        self._finish = self.r.register_script(FINISH)
        self._meta_script = self.r.register_script(META)
        self._admit = self.r.register_script(ADMIT)
        self._sids: dict[str, str] = {}  # group id -> stream entry id (held or delivered)
        self.retries = 0
        self._retry(self._load)
        # the docs promise a buffer that survives a restart of Redis: say so when this Redis cannot (item 12)
        self.durability = self._retry(durability_warnings, self.r)
        for warning in self.durability:
            log.warning("buffer: Redis at %s (prefix %s) is not durable: %s", self._safe_url(), self.prefix, warning)

    # -- plumbing ---------------------------------------------------------------------------
    def _retry(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn``; while Redis is unreachable (down, restarting, loading its AOF) wait and run it again."""
        def note(exc: BaseException, _delay: float, left: float) -> None:
            self.retries += 1
            log.warning("buffer: Redis at %s unavailable (%s); retrying for up to %.0f s", self._safe_url(), exc, left)

        return retry(lambda: fn(*args), _RETRYABLE, self.retry_s, first_delay_s=0.02, max_delay_s=0.5,
                     on_retry=note)

    def _safe_url(self) -> str:
        kw = self.r.connection_pool.connection_kwargs
        return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"

    # -- recovery ---------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            self.r.xgroup_create(self.k_stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        MemoryStore.__init__(self)
        self._sids = {}
        self._meta = {k.decode(): int(v) for k, v in self.r.hgetall(self.k_meta).items()}
        self._trained = {g.decode() for g in self.r.smembers(self.k_trained)}
        self._dropped = {k.decode(): v.decode() for k, v in self.r.hgetall(self.k_dropped).items()}
        deliv = {k.decode(): v.decode().split() for k, v in self.r.hgetall(self.k_deliv).items()}
        while self.r.xreadgroup(GROUP, HELD_CONSUMER, {self.k_stream: ">"}, count=1000):
            pass
        entries: dict[str, dict[bytes, bytes]] = {}
        start = "-"
        while True:
            page = self.r.xrange(self.k_stream, min=start, max="+", count=500)
            for sid, fields in page:
                entries[sid.decode()] = fields
            if len(page) < 500:
                break
            start = "(" + page[-1][0].decode()
        owners: dict[str, tuple[str, int]] = {}
        start = "-"
        while True:
            page = self.r.xpending_range(self.k_stream, GROUP, min=start, max="+", count=1000)
            for p in page:
                owners[p["message_id"].decode()] = (p["consumer"].decode(), int(p["time_since_delivered"]))
            if len(page) < 1000:
                break
            start = "(" + page[-1]["message_id"].decode()
        payloads = self._payloads([f[b"g"] for f in entries.values()])
        now = time.time()
        for seq, sid in enumerate(sorted(entries, key=lambda s: tuple(map(int, s.split("-")))), start=1):
            f = entries[sid]
            gid = f[b"g"].decode()
            data = f.get(b"d") or payloads.get(gid)  # "d": an entry written before payloads moved to P:data
            if data is None:
                raise RuntimeError(f"Redis prefix {self.prefix}: stream entry {sid} of group {gid} has no payload "
                                   f"in {self.k_data}; the store was changed outside this service")
            group = StoredGroup(gid, int(f[b"v"]), int(f[b"n"]), int(f[b"t"]), data, seq=seq)
            version, deliveries = (int(deliv[gid][0]), int(deliv[gid][1])) if gid in deliv else (0, 0)
            group.deliveries = deliveries
            owner, idle_ms = owners.get(sid, (HELD_CONSUMER, 0))
            self._sids[gid] = sid
            if owner == HELD_CONSUMER:
                self._held[gid] = group
            elif owner == AWAITING_CONSUMER:
                group.since = now - idle_ms / 1000
                self._awaiting[gid] = group
            else:
                self._delivered[gid] = (group, Delivery(owner, version, now - idle_ms / 1000))
            self._seq = seq
        log.info("buffer: recovered from Redis %s prefix %s: %d held, %d awaiting reward, %d delivered, %d trained, "
                 "%d dropped, meta %s", self._safe_url(), self.prefix, len(self._held), len(self._awaiting),
                 len(self._delivered),
                 len(self._trained), len(self._dropped), self._meta)

    def _payloads(self, gids: list[bytes]) -> dict[str, bytes]:
        """The stored payloads of these groups; payloads of no group (a put cut short) are deleted."""
        out: dict[str, bytes] = {}
        for i in range(0, len(gids), 256):
            page = gids[i:i + 256]
            for gid, data in zip(page, self.r.hmget(self.k_data, page), strict=True):
                if data is not None:
                    out[gid.decode()] = data
        orphans = set(self.r.hkeys(self.k_data)) - set(gids)
        if orphans:
            log.info("buffer: dropping %d payloads whose put never completed", len(orphans))
            self.r.hdel(self.k_data, *orphans)
        return out

    # -- transitions: Redis first (atomic, durable), then the mirror -------------------------
    def put(self, group: StoredGroup, meta: Mapping[str, int] | None = None, *, awaiting: bool = False) -> bool:
        return self.put_many([group], meta, awaiting=awaiting)[0]

    def put_many(self, groups: list[StoredGroup], meta: Mapping[str, int] | None = None, *,
                 awaiting: bool = False) -> list[bool]:
        fresh = [g for g in groups if self.state(g.group_id) is None]
        fields: list[Any] = []
        for g in fresh:
            fields += [g.group_id, g.min_version, g.num_samples, g.num_tokens]
        consumer = AWAITING_CONSUMER if awaiting else HELD_CONSUMER

        def put() -> list[Any]:  # payloads, then the entries: one round trip, and safe to repeat
            pipe = self.r.pipeline(transaction=False)
            if fresh:
                pipe.hset(self.k_data, mapping={g.group_id: g.data for g in fresh})
            self._put([self.k_stream, self.k_ids, self.k_meta], [GROUP, consumer, len(fresh), *fields,
                                                                 *_pairs(meta)], client=pipe)
            return pipe.execute()[-1]

        sids = self._retry(put)
        for g, sid in zip(fresh, sids, strict=True):
            self._sids[g.group_id] = sid.decode() if isinstance(sid, bytes) else str(sid)
        return super().put_many(groups, meta, awaiting=awaiting)

    def reward(self, group_id: str, data: bytes, meta: Mapping[str, int] | None = None) -> bool:
        g = self._awaiting.get(group_id)
        if g is None:
            return False
        def reward() -> Any:
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(self.k_data, group_id, data)
            self._reward([self.k_stream, self.k_ids, self.k_meta],
                         [GROUP, group_id, self._sids[group_id], g.min_version, g.num_samples, g.num_tokens,
                          *_pairs(meta)], client=pipe)
            return pipe.execute()[-1]

        sid = self._retry(reward)
        self._sids[group_id] = sid.decode() if isinstance(sid, bytes) else str(sid)
        return super().reward(group_id, data, meta)

    def deliver(self, group_ids: list[str], consumer: str, version: int,
                meta: Mapping[str, int] | None = None) -> list[StoredGroup]:
        gids = [g for g in group_ids if g in self._held]
        if consumer in RESERVED:
            raise ValueError(f"consumer names {RESERVED} are reserved")
        sids = [self._sids[g] for g in gids]
        deliv = [f"{version} {self._held[g].deliveries + 1}" for g in gids]
        self._retry(self._deliver, [self.k_stream, self.k_deliv, self.k_meta],
                    [GROUP, consumer, len(gids), *sids, *gids, *deliv, *_pairs(meta)])
        return super().deliver(gids, consumer, version, meta)

    def _finish_ids(self, gids: list[str], reason: str, meta: Mapping[str, int] | None) -> None:
        final = self.k_dropped if reason else self.k_trained
        sids = [self._sids[g] for g in gids]
        self._retry(self._finish, [self.k_stream, self.k_ids, self.k_deliv, final, self.k_meta, self.k_data],
                    [GROUP, reason, len(gids), *sids, *gids, *_pairs(meta)])
        for g in gids:
            self._sids.pop(g, None)

    def ack(self, group_ids: list[str], meta: Mapping[str, int] | None = None) -> list[str]:
        gids = [g for g in dict.fromkeys(group_ids)
                if g in self._delivered or (g in self._held and self._held[g].deliveries > 0)]
        self._finish_ids(gids, "", meta)
        return super().ack(gids, meta)

    def drop(self, group_ids: list[str], reason: str, meta: Mapping[str, int] | None = None) -> list[str]:
        if not reason:
            raise ValueError("a drop needs a reason")
        gids = [g for g in dict.fromkeys(group_ids)
                if g in self._held or g in self._delivered or g in self._awaiting]
        self._finish_ids(gids, reason, meta)
        return super().drop(gids, reason, meta)

    def redeliver(self, group_ids: list[str], meta: Mapping[str, int] | None = None) -> list[str]:
        gids = [g for g in dict.fromkeys(group_ids) if g in self._delivered]
        sids = [self._sids[g] for g in gids]
        deliv = [f"{self._delivered[g][1].version} {self._delivered[g][0].deliveries}" for g in gids]
        self._retry(self._deliver, [self.k_stream, self.k_deliv, self.k_meta],
                    [GROUP, HELD_CONSUMER, len(gids), *sids, *gids, *deliv, *_pairs(meta)])
        return super().redeliver(gids, meta)

    def renew(self, group_ids: list[str], consumer: str) -> list[str]:
        gids = [g for g in dict.fromkeys(group_ids)
                if g in self._delivered and self._delivered[g][1].consumer == consumer]
        if gids:  # XCLAIM to the same consumer: its idle time (the delivery's age after a restart) starts again
            sids = [self._sids[g] for g in gids]
            self._retry(lambda: self.r.xclaim(self.k_stream, GROUP, consumer, 0, sids, justid=True))
        return super().renew(gids, consumer)

    def save_admit(self, request_id: str, granted: int, version: int, keep: int, meta: Mapping[str, int]) -> None:
        self._retry(self._admit, [self.k_admits, self.k_admit_order, self.k_meta],
                    [request_id, f"{granted} {version}", keep, *_pairs(meta)])
        super().save_admit(request_id, granted, version, keep, meta)

    def admits(self) -> dict[str, tuple[int, int]]:
        answers = self.r.hgetall(self.k_admits)
        out: dict[str, tuple[int, int]] = {}
        for rid in reversed(self.r.lrange(self.k_admit_order, 0, -1)):
            if rid in answers:
                granted, version = answers[rid].split()
                out[rid.decode()] = (int(granted), int(version))
        return out

    def save_meta(self, meta: Mapping[str, int]) -> None:
        if meta:
            self._retry(self._meta_script, [self.k_meta], _pairs(meta))
        super().save_meta(meta)

    # -- tools ------------------------------------------------------------------------------
    def wipe(self) -> None:
        """Delete every key of this prefix (tests and benchmarks)."""
        self.r.delete(self.k_stream, self.k_ids, self.k_deliv, self.k_trained, self.k_dropped, self.k_meta,
                      self.k_admits, self.k_admit_order, self.k_data)
        self._load()

    def close(self) -> None:
        self.r.close()
