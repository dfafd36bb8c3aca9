"""Runs on a Redis used before (issue 44, defect 4 and item 12), against a real redis-server.

    first run (id A) on prefix P   holds groups, version 3, a generator's admission slots
    a new run (id B) on P          starts clean: no held group, version 0; its first version is 1
    --resume of the first run      finds its own held groups and version under P:A
    a buffer restarted on Redis    still releases a dead generator's slots (per-holder counts are saved)
    a Redis that may lose or evict keys is named at buffer start (appendonly, maxmemory-policy)
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import redis

from async_rlhf.buffer.build import build_logic
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.redis_store import RedisStore
from async_rlhf.buffer.run_scope import run_id_for, run_prefix
from async_rlhf.buffer.testing import RedisServer, make_group
from async_rlhf.config import Config, load_config

pytestmark = pytest.mark.integration

PREFIX = "used"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield srv
    finally:
        srv.stop()


def config(url: str) -> Config:
    return load_config(None, ["buffer.store=redis", f"buffer.redis_url={url}", f"buffer.redis_prefix={PREFIX}",
                              "train.batch_size=2", "train.max_staleness=1"])


def start(cfg: Config, run_dir: Path, resume: Path | None) -> BufferLogic:
    """What the driver does: the run's id (new, or the resumed run's), config.json, then the buffer."""
    cfg = copy.deepcopy(cfg)
    cfg.run.id = run_id_for(run_dir, resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    return build_logic(cfg)


def test_a_new_run_on_a_used_prefix_starts_clean_and_a_resume_finds_its_own(server: RedisServer, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture):
    cfg = config(server.url)
    first_dir = tmp_path / "first"
    first = start(cfg, first_dir, None)
    assert first.admit(4, holder="generator-0")["granted"] == 4
    for i in range(4):
        first.put(make_group(f"g0-a-{i + 1}", version=2 + i // 2, samples=2).to_wire(), holder="generator-0")
    for v in (1, 2, 3):
        first.set_version(v)
    held = {g.group_id for g in first.store.held()}
    assert len(held) >= 2 and first.admission.version == 3
    first.store.close()

    with caplog.at_level(logging.WARNING):
        fresh = start(cfg, tmp_path / "second", None)
    # nothing of the earlier run: no held group to train with negative staleness, no version to go back from
    assert not list(fresh.store.held()) and fresh.store.meta() == {}
    assert (fresh.admission.version, fresh.admission.accepted, fresh.admission.running) == (0, 0, 0)
    assert fresh.try_get(2, 0, "learner-0") is None
    fresh.set_version(1)  # the old run's version 3 made this "learner version went backwards"
    assert f"Redis prefix {PREFIX} holds the buffer state of 1 earlier run" in caplog.text
    fresh.store.close()

    # the first run resumed (from a checkpoint of its run directory) finds its own state
    resumed = start(cfg, first_dir, first_dir / "checkpoints" / "step-2")
    assert resumed.store.prefix == run_prefix(first_dir, PREFIX) != PREFIX
    assert {g.group_id for g in resumed.store.held()} == held and resumed.admission.version == 3
    resumed.store.close()


def test_a_restarted_redis_buffer_still_releases_a_dead_generators_slots(server: RedisServer):
    store = RedisStore(server.url, prefix="holders")
    store.wipe()
    logic = BufferLogic(store, groups_per_version=4, max_staleness=1)
    logic.admit(3, holder="generator-0")
    logic.admit(2, holder="generator-1")
    logic.put(make_group("g1-a-1").to_wire(), holder="generator-1")
    logic.release(1, holder="generator-1")  # generator-1 holds nothing now: saved as 0, not as its last count
    store.close()
    restarted = BufferLogic(RedisStore(server.url, prefix="holders"), groups_per_version=4, max_staleness=1)
    assert dict(restarted.holdings) == {"generator-0": 3}
    assert restarted.release_holder("generator-0") == {"released": 3}
    assert restarted.release_holder("generator-1") == {"released": 0}
    assert restarted.admission.running == 0
    restarted.store.close()


def test_a_redis_that_may_lose_or_evict_the_buffer_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    srv = RedisServer(tmp_path / "redis").start()
    try:
        with caplog.at_level(logging.WARNING):
            durable = RedisStore(srv.url, prefix="d")
        assert durable.durability == [] and "not durable" not in caplog.text
        durable.close()
        client = redis.Redis.from_url(srv.url)
        client.config_set("appendonly", "no")
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.close()
        with caplog.at_level(logging.WARNING):
            store = RedisStore(srv.url, prefix="d")
        store.close()
        assert len(store.durability) == 2
        assert "appendonly is 'no'" in caplog.text and "appendonly yes" in caplog.text
        assert "maxmemory-policy is 'allkeys-lru'" in caplog.text and "noeviction" in caplog.text
    finally:
        srv.stop()
