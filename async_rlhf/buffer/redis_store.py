"""Redis Streams store: the buffer's state survives a SIGKILL of the service and a restart of Redis.

Key layout (``P`` is ``buffer.redis_prefix``; one buffer service writes one prefix)::

    P:stream   STREAM  one entry per held or delivered group   g=<group id> v=<min version> n=<samples>
                       |                                       t=<tokens> d=<msgpack of the wire group>
                       '- consumer group "learners"; its pending-entry list (PEL) says who owns what:
                            consumer "_held"          -> held      (waiting for a learner)
                            consumer "<learner name>" -> delivered (idle time = time since delivery)
    P:ids      HASH    group id -> stream entry id   (held or delivered; the idempotency index of put)
    P:deliv    HASH    group id -> "<learner version> <deliveries>"   (set at delivery, kept while held again)
    P:trained  SET     group ids acknowledged: never delivered again
    P:dropped  HASH    group id -> reason
    P:meta     HASH    admission (version, accepted, running) and service counters (c:put, c:trained, ...)

Transitions, each ONE Lua script (atomic; with ``appendfsync always`` durable before the reply)::

    put        XADD P:stream; XREADGROUP into "_held" (the entry enters the PEL); HSET P:ids; HSET P:meta
    deliver    XCLAIM <ids> to <learner> JUSTID (idle -> 0); HSET P:deliv; HSET P:meta
    ack        XACK + XDEL; HDEL P:ids P:deliv; SADD P:trained; HSET P:meta
    drop       XACK + XDEL; HDEL P:ids P:deliv; HSET P:dropped; HSET P:meta
    redeliver  XCLAIM <ids> back to "_held" JUSTID; HSET P:meta

Recovery protocol (service start, e.g. after SIGKILL)::

    1. XGROUP CREATE P:stream learners 0 MKSTREAM      (BUSYGROUP: it exists, keep it)
    2. HGETALL P:meta, SMEMBERS P:trained, HGETALL P:dropped, HGETALL P:deliv
    3. XREADGROUP ... ">" into "_held" until empty     (adopts any entry no group read; none is expected)
    4. XRANGE P:stream (paged) for the payloads; XPENDING (paged) for owner and idle time:
         owner "_held" -> held; any other owner -> delivered to it, delivered at now - idle
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

import msgpack
import redis

from async_rlhf.buffer.store import Delivery, MemoryStore, StoredGroup

log = logging.getLogger(__name__)
T = TypeVar("T")

GROUP = "learners"
HELD_CONSUMER = "_held"

_PUT = """
local sid = redis.call('HGET', KEYS[2], ARGV[1])
if sid then return sid end
sid = redis.call('XADD', KEYS[1], '*', 'g', ARGV[1], 'v', ARGV[2], 'n', ARGV[3], 't', ARGV[4], 'd', ARGV[5])
redis.call('XREADGROUP', 'GROUP', ARGV[6], ARGV[7], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
redis.call('HSET', KEYS[2], ARGV[1], sid)
if #ARGV > 7 then redis.call('HSET', KEYS[3], unpack(ARGV, 8)) end
return sid
"""

# ARGV: group, consumer, k, sid_1..sid_k, gid_1..gid_k, deliv_1..deliv_k, meta pairs...
_DELIVER = """
local k = tonumber(ARGV[3])
if k > 0 then
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for i = 1, k do args[5 + i] = ARGV[3 + i] end
  args[6 + k] = 'JUSTID'
  redis.call(unpack(args))  -- (unpack must come last in a call: Lua truncates it to one value otherwise)
  for i = 1, k do redis.call('HSET', KEYS[2], ARGV[3 + k + i], ARGV[3 + 2 * k + i]) end
end
if #ARGV > 3 + 3 * k then redis.call('HSET', KEYS[3], unpack(ARGV, 4 + 3 * k)) end
return k
"""

# KEYS: stream, ids, deliv, final (trained set | dropped hash), meta
# ARGV: group, reason ('' = trained), k, sid_1..sid_k, gid_1..gid_k, meta pairs...
_FINISH = """
local k = tonumber(ARGV[3])
if k > 0 then
  local sids = {unpack(ARGV, 4, 3 + k)}
  local gids = {unpack(ARGV, 4 + k, 3 + 2 * k)}
  redis.call('XACK', KEYS[1], ARGV[1], unpack(sids))
  redis.call('XDEL', KEYS[1], unpack(sids))
  redis.call('HDEL', KEYS[2], unpack(gids))
  redis.call('HDEL', KEYS[3], unpack(gids))
  if ARGV[2] == '' then
    redis.call('SADD', KEYS[4], unpack(gids))
  else
    for i = 1, k do redis.call('HSET', KEYS[4], gids[i], ARGV[2]) end
  end
end
if #ARGV > 3 + 2 * k then redis.call('HSET', KEYS[5], unpack(ARGV, 4 + 2 * k)) end
return k
"""

_META = """
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

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
        self._put = self.r.register_script(_PUT)
        self._deliver = self.r.register_script(_DELIVER)
        self._finish = self.r.register_script(_FINISH)
        self._meta_script = self.r.register_script(_META)
        self._sids: dict[str, str] = {}  # group id -> stream entry id (held or delivered)
        self.retries = 0
        self._retry(self._load)

    # -- plumbing ---------------------------------------------------------------------------
    def _retry(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn``; while Redis is unreachable (down, restarting, loading its AOF) wait and run it again."""
        deadline = time.monotonic() + self.retry_s
        delay = 0.02
        while True:
            try:
                return fn(*args)
            except _RETRYABLE as exc:
                if time.monotonic() >= deadline:
                    raise
                self.retries += 1
                log.warning("buffer: Redis at %s unavailable (%s); retrying for up to %.0f s",
                            self._safe_url(), exc, deadline - time.monotonic())
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

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
        now = time.time()
        for seq, sid in enumerate(sorted(entries, key=lambda s: tuple(map(int, s.split("-")))), start=1):
            f = entries[sid]
            gid = f[b"g"].decode()
            group = StoredGroup(gid, int(f[b"v"]), int(f[b"n"]), int(f[b"t"]),
                                msgpack.unpackb(f[b"d"], raw=False), seq=seq)
            version, deliveries = (int(deliv[gid][0]), int(deliv[gid][1])) if gid in deliv else (0, 0)
            group.deliveries = deliveries
            owner, idle_ms = owners.get(sid, (HELD_CONSUMER, 0))
            self._sids[gid] = sid
            if owner == HELD_CONSUMER:
                self._held[gid] = group
            else:
                self._delivered[gid] = (group, Delivery(owner, version, now - idle_ms / 1000))
            self._seq = seq
        log.info("buffer: recovered from Redis %s prefix %s: %d held, %d delivered, %d trained, %d dropped, "
                 "meta %s", self._safe_url(), self.prefix, len(self._held), len(self._delivered),
                 len(self._trained), len(self._dropped), self._meta)

    # -- transitions: Redis first (atomic, durable), then the mirror -------------------------
    def put(self, group: StoredGroup, meta: Mapping[str, int] | None = None) -> bool:
        if self.state(group.group_id) is not None:
            return False
        data = msgpack.packb(group.wire, use_bin_type=True)
        sid = self._retry(self._put, [self.k_stream, self.k_ids, self.k_meta],
                          [group.group_id, group.min_version, group.num_samples, group.num_tokens, data,
                           GROUP, HELD_CONSUMER, *_pairs(meta)])
        self._sids[group.group_id] = sid.decode() if isinstance(sid, bytes) else str(sid)
        return super().put(group, meta)

    def deliver(self, group_ids: list[str], consumer: str, version: int,
                meta: Mapping[str, int] | None = None) -> list[StoredGroup]:
        gids = [g for g in group_ids if g in self._held]
        if consumer == HELD_CONSUMER:
            raise ValueError(f"consumer name {HELD_CONSUMER!r} is reserved")
        sids = [self._sids[g] for g in gids]
        deliv = [f"{version} {self._held[g].deliveries + 1}" for g in gids]
        self._retry(self._deliver, [self.k_stream, self.k_deliv, self.k_meta],
                    [GROUP, consumer, len(gids), *sids, *gids, *deliv, *_pairs(meta)])
        return super().deliver(gids, consumer, version, meta)

    def _finish_ids(self, gids: list[str], reason: str, meta: Mapping[str, int] | None) -> None:
        final = self.k_dropped if reason else self.k_trained
        sids = [self._sids[g] for g in gids]
        self._retry(self._finish, [self.k_stream, self.k_ids, self.k_deliv, final, self.k_meta],
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
        gids = [g for g in dict.fromkeys(group_ids) if g in self._held or g in self._delivered]
        self._finish_ids(gids, reason, meta)
        return super().drop(gids, reason, meta)

    def redeliver(self, group_ids: list[str], meta: Mapping[str, int] | None = None) -> list[str]:
        gids = [g for g in dict.fromkeys(group_ids) if g in self._delivered]
        sids = [self._sids[g] for g in gids]
        deliv = [f"{self._delivered[g][1].version} {self._delivered[g][0].deliveries}" for g in gids]
        self._retry(self._deliver, [self.k_stream, self.k_deliv, self.k_meta],
                    [GROUP, HELD_CONSUMER, len(gids), *sids, *gids, *deliv, *_pairs(meta)])
        return super().redeliver(gids, meta)

    def save_meta(self, meta: Mapping[str, int]) -> None:
        if meta:
            self._retry(self._meta_script, [self.k_meta], _pairs(meta))
        super().save_meta(meta)

    # -- legacy helpers would bypass the ledger in Redis: refuse them -------------------------
    def take(self, n: int) -> list[StoredGroup]:
        raise NotImplementedError("RedisStore records every transition; use deliver/drop")

    def remove(self, group_ids: list[str]) -> None:
        raise NotImplementedError("RedisStore records every transition; use drop")

    def wipe(self) -> None:
        """Delete every key of this prefix (tests and benchmarks)."""
        self.r.delete(self.k_stream, self.k_ids, self.k_deliv, self.k_trained, self.k_dropped, self.k_meta)
        self._load()

    def close(self) -> None:
        self.r.close()
