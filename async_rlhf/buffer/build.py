"""Build the buffer service from the typed config (shared by the Ray actor and ``python -m async_rlhf.buffer``)."""

from __future__ import annotations

from async_rlhf.buffer.client import BufferClient
from async_rlhf.buffer.curve import CurveClientKeys, CurveServerKeys, parse_keys
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.run_scope import scoped_prefix
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import MemoryStore, Store
from async_rlhf.config import BufferConfig, Config, drops_zero_advantage
from async_rlhf.endpoints import LOOPBACK_HOST, node_ip, node_mode, run_keys


def make_store(kind: str, url: str = "", prefix: str = "async_rlhf:buffer", retry_s: float = 30.0) -> Store:
    """``buffer.store``: the embedded memory store, or Redis (imported only when asked for)."""
    if kind == "memory":
        return MemoryStore()
    if kind == "redis":
        from async_rlhf.buffer.redis_store import RedisStore

        return RedisStore(url, prefix=prefix, retry_s=retry_s)
    raise ValueError(f"buffer.store={kind!r} is not known; use buffer.store=memory or buffer.store=redis")


def build_logic(cfg: Config) -> BufferLogic:
    b = cfg.buffer
    # a run's Redis keys live under prefix:<run id>: a new run never inherits an earlier one's (run_scope.py)
    store = make_store(b.store, url=b.redis_url, prefix=scoped_prefix(b.redis_prefix, cfg.run.id),
                       retry_s=b.redis_retry_s)
    if b.store == "redis" and cfg.run.id:
        notice_earlier_runs(store, b.redis_prefix, cfg.run.id)
    return BufferLogic(store, groups_per_version=cfg.train.batch_size * cfg.train.push_every,
                       max_staleness=cfg.train.max_staleness, capacity=b.capacity, policy=b.policy,
                       visibility_timeout_s=b.visibility_timeout_s, reward_deadline_s=b.reward_deadline_s,
                       drop_zero_advantage=drops_zero_advantage(cfg.train))


def notice_earlier_runs(store: Store, prefix: str, run_id: str) -> None:
    """Say (once, at a fresh start) that other runs' buffer states lie under ``prefix``: never read by this run."""
    from async_rlhf.buffer.run_scope import earlier_runs

    if store.meta() or len(store):  # a restart or a resume of this run
        return
    others = earlier_runs(store.r, prefix, run_id)  # type: ignore[attr-defined]
    if others:
        import logging

        logging.getLogger(__name__).warning(
            "buffer: Redis prefix %s holds the buffer state of %d earlier run(s) (%s%s); this run (id %s) keeps its "
            "keys under %s:%s and never reads theirs. Delete them once no run will resume them (redis-cli --scan "
            "--pattern '%s:*' lists every key under the prefix)", prefix, len(others), ", ".join(others[:3]),
            ", ..." if len(others) > 3 else "", run_id, prefix, run_id, prefix)


def server_keys(b: BufferConfig) -> CurveServerKeys | None:
    """The service's keys: the configured ones, else the run's own (a run across nodes), else None."""
    if b.curve:
        return CurveServerKeys(b.curve_secret_key, b.curve_public_key, parse_keys(b.curve_client_keys))
    keys = run_keys()
    if keys is None:
        return None
    return CurveServerKeys(keys["server_secret"], keys["server_public"], [keys["client_public"]])


def client_keys(b: BufferConfig) -> CurveClientKeys | None:
    """The keys a generator or learner presents (None when CURVE is off)."""
    if b.curve:
        return CurveClientKeys(b.curve_client_secret_key, b.curve_client_public_key, b.curve_public_key)
    keys = run_keys()
    if keys is None:
        return None
    return CurveClientKeys(keys["client_secret"], keys["client_public"], keys["server_public"])


def service_host(b: BufferConfig) -> str:
    """``buffer.host``; in a run across nodes the default loopback becomes this node's IP (other nodes dial it)."""
    return node_ip() if node_mode() and b.host == LOOPBACK_HOST else b.host


def build_service(cfg: Config) -> BufferService:
    b = cfg.buffer
    return BufferService(build_logic(cfg), service_host(b), b.port, b.max_message_mb << 20, curve=server_keys(b))


def make_client(cfg: Config, address: str, consumer: str | None = None) -> BufferClient:
    """A client of the run's buffer service, with the run's timeouts and CURVE keys."""
    b = cfg.buffer
    return BufferClient(address, b.request_timeout_s, b.max_message_mb << 20, consumer=consumer,
                        curve=client_keys(b))
