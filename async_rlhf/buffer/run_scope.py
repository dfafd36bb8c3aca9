"""Which run a Redis buffer's keys belong to, and whether that Redis keeps them (issue 44, defect 4 and item 12).

A run takes an id at its first start (``run.id``, written to ``run.dir/config.json``); ``--resume`` reads it back
from there. The Redis buffer's keys live under ``buffer.redis_prefix:<run id>``, so a new run on a prefix used
before never sees the held groups, admission counts or version of the earlier run (they would be trained with
negative staleness, then the learner's first version would go backwards), and a resumed run finds its own. A run
directory written before ids existed resumes on the bare prefix, as it was written.

    fresh run            run.id = new id              keys  P:<id>:stream, P:<id>:meta, ...
    --resume run.dir     run.id = config.json's id    keys  the same (its held groups are trained after the resume)
    no id (a tool, an old run directory)              keys  P:stream, P:meta, ...
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def recorded_run_id(run_dir: str | Path) -> str:
    """The id ``run_dir/config.json`` records ("" when none: a run written before ids existed, or no run)."""
    try:
        recorded = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    run = recorded.get("run") if isinstance(recorded, dict) else None
    return str(run.get("id") or "") if isinstance(run, dict) else ""


def run_id_for(run_dir: str | Path, resume: str | Path | None) -> str:
    """The id of the run in ``run_dir``: a new one for a fresh run; for a ``resume`` (a checkpoint), the one its run
    directory's ``config.json`` recorded ("" for a run written before ids existed: its keys are under the bare
    prefix)."""
    if resume is None:
        return new_run_id()
    from async_rlhf.checkpoint_layout import run_dir_of

    return recorded_run_id(run_dir_of(Path(resume))) or recorded_run_id(run_dir)


def run_prefix(run_dir: str | Path, prefix: str) -> str:
    """The Redis key prefix the buffer of the run in ``run_dir`` used under ``buffer.redis_prefix`` (tools, tests)."""
    return scoped_prefix(prefix, recorded_run_id(run_dir))


def scoped_prefix(prefix: str, run_id: str) -> str:
    """The Redis key prefix of run ``run_id``'s buffer under ``buffer.redis_prefix``."""
    return f"{prefix}:{run_id}" if run_id else prefix


def durability_warnings(client: Any) -> list[str]:
    """What makes this Redis lose or evict the buffer's keys: no append-only file, or a ``maxmemory-policy`` other
    than ``noeviction``; a server whose CONFIG command is disabled (a managed Redis) is said to be unchecked."""
    import redis

    try:
        conf = {**client.config_get("appendonly"), **client.config_get("maxmemory-policy")}
    except redis.ResponseError as exc:
        return [f"could not read its persistence settings (CONFIG GET: {exc}); make sure it runs with appendonly "
                "yes and maxmemory-policy noeviction, or a restart of Redis loses the buffer's groups and an "
                "eviction drops them silently"]
    out = []
    if str(conf.get("appendonly", "")).lower() != "yes":
        out.append(f"appendonly is {conf.get('appendonly')!r}: a restart of Redis loses every group the buffer holds; "
                   "run it with appendonly yes (redis-cli CONFIG SET appendonly yes, and in redis.conf)")
    policy = str(conf.get("maxmemory-policy", ""))
    if policy and policy != "noeviction":
        out.append(f"maxmemory-policy is {policy!r}: Redis may evict the buffer's keys under memory pressure and "
                   "lose groups without a word; set maxmemory-policy noeviction (redis-cli CONFIG SET "
                   "maxmemory-policy noeviction, and in redis.conf)")
    return out


def earlier_runs(client: Any, prefix: str, run_id: str, limit: int = 100, max_scans: int = 64) -> list[str]:
    """Buffer states of other runs under ``prefix`` (their meta keys; at most ``limit``): left alone, named in a
    notice so that whoever owns the Redis can delete them. SCAN walks the whole keyspace: at most ``max_scans``
    pages of it are read (a shared Redis with millions of keys is not walked at every start)."""
    own = f"{scoped_prefix(prefix, run_id)}:meta"
    found: list[str] = []
    cursor = 0
    for _ in range(max_scans):
        cursor, keys = client.scan(cursor, match=f"{prefix}:*meta", count=1000)
        for key in keys:
            name = key.decode() if isinstance(key, bytes) else str(key)
            if name != own and name.endswith(":meta"):
                found.append(name)
        if not cursor or len(found) >= limit:
            break
    return sorted(found)[:limit]


def redis_warnings(url: str) -> list[str]:
    """:func:`durability_warnings` of the Redis at ``url``, each naming it (password masked), for the driver's console
    at start; an unreachable Redis says nothing here (the buffer retries and names it)."""
    import redis

    from async_rlhf.config.secrets import mask_url

    client = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)
    try:
        return [f"the buffer's Redis at {mask_url(url)}: {w}" for w in durability_warnings(client)]
    except redis.RedisError:
        return []
    finally:
        client.close()
