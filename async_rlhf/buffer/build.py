"""Build the buffer service from the typed config (shared by the Ray actor and ``python -m async_rlhf.buffer``)."""

from __future__ import annotations

from async_rlhf.buffer.client import BufferClient
from async_rlhf.buffer.curve import CurveClientKeys, CurveServerKeys, parse_keys
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import make_store
from async_rlhf.config import BufferConfig, Config, drops_zero_advantage


def build_logic(cfg: Config) -> BufferLogic:
    b = cfg.buffer
    store = make_store(b.store, url=b.redis_url, prefix=b.redis_prefix, retry_s=b.redis_retry_s)
    return BufferLogic(store, groups_per_version=cfg.train.batch_size * cfg.train.push_every,
                       max_staleness=cfg.train.max_staleness, capacity=b.capacity, policy=b.policy,
                       visibility_timeout_s=b.visibility_timeout_s, reward_deadline_s=b.reward_deadline_s,
                       drop_zero_advantage=drops_zero_advantage(cfg.train))


def server_keys(b: BufferConfig) -> CurveServerKeys | None:
    if not b.curve:
        return None
    return CurveServerKeys(b.curve_secret_key, b.curve_public_key, parse_keys(b.curve_client_keys))


def client_keys(b: BufferConfig) -> CurveClientKeys | None:
    """The keys a generator or learner presents (None when CURVE is off)."""
    if not b.curve:
        return None
    return CurveClientKeys(b.curve_client_secret_key, b.curve_client_public_key, b.curve_public_key)


def build_service(cfg: Config) -> BufferService:
    b = cfg.buffer
    return BufferService(build_logic(cfg), b.host, b.port, b.max_message_mb << 20, curve=server_keys(b))


def make_client(cfg: Config, address: str, consumer: str | None = None) -> BufferClient:
    """A client of the run's buffer service, with the run's timeouts and CURVE keys."""
    b = cfg.buffer
    return BufferClient(address, b.request_timeout_s, b.max_message_mb << 20, consumer=consumer,
                        curve=client_keys(b))
