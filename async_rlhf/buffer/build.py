"""Build the buffer service from the typed config (shared by the Ray actor and ``python -m async_rlhf.buffer``)."""

from __future__ import annotations

from async_rlhf.buffer.client import BufferClient
from async_rlhf.buffer.curve import CurveClientKeys, CurveServerKeys, parse_keys
from async_rlhf.buffer.logic import BufferLogic
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
    store = make_store(b.store, url=b.redis_url, prefix=b.redis_prefix, retry_s=b.redis_retry_s)
    return BufferLogic(store, groups_per_version=cfg.train.batch_size * cfg.train.push_every,
                       max_staleness=cfg.train.max_staleness, capacity=b.capacity, policy=b.policy,
                       visibility_timeout_s=b.visibility_timeout_s, reward_deadline_s=b.reward_deadline_s,
                       drop_zero_advantage=drops_zero_advantage(cfg.train))


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
