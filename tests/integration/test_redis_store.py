"""RedisStore against a real redis-server: same behaviour as the memory store, and every state reloads."""

import time

import pytest
import redis

from async_rlhf.buffer.build import make_store
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.redis_store import GROUP, HELD_CONSUMER, RedisStore
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.buffer.testing import RedisServer, make_group

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"), password="s3cret").start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def store(server: RedisServer, request: pytest.FixtureRequest) -> RedisStore:
    s = RedisStore(server.url, prefix=f"t:{request.node.name}")
    s.wipe()
    return s


def view(logic: BufferLogic) -> dict:
    s = logic.stats(ledger=True)
    st = logic.store
    return {
        "ledger": s["ledger"],
        "counters": {k: v for k, v in logic.counters.items()},
        "admission": (logic.admission.version, logic.admission.accepted, logic.admission.running),
        "held": [(g.group_id, g.min_version, g.num_tokens, g.deliveries, g.wire) for g in st.peek_all()],
        "delivered": {gid: (d.consumer, d.version) for gid, d in st.delivered().items()},
    }


WIRES = [make_group(f"g{i}", version=i // 3).to_wire() for i in range(6)]


def scenario(logic: BufferLogic, check) -> None:
    """A run through every transition; ``check()`` after each one."""
    steps = [
        lambda: logic.admit(6),
        *[lambda i=i: logic.put(WIRES[i]) for i in range(6)],
        lambda: logic.put(WIRES[0]),                            # duplicate
        lambda: logic.try_get(2, 0, "alice"),
        lambda: logic.try_get(1, 1, "bob"),
        lambda: logic.ack(["g0", "zzz"]),
        lambda: logic.set_version(2),
        lambda: logic.declare_dead("alice"),                    # g1 back to held
        lambda: logic.try_get(2, 2, "carol"),                   # g1 (v0) is stale at v2: dropped
        lambda: logic.ack(["g3"]),                              # carol trained g3, still holds g4
        lambda: logic.release(1),
        lambda: logic.drop_held("end_of_run"),
    ]
    for step in steps:
        step()
        check()


def test_redis_store_matches_memory_store_and_reloads_after_every_step(store: RedisStore, server: RedisServer):
    mem = BufferLogic(MemoryStore(), groups_per_version=3, max_staleness=1)
    red = BufferLogic(store, groups_per_version=3, max_staleness=1)
    mem_views = []
    scenario(mem, lambda: mem_views.append(view(mem)))
    reloads = 0

    def check() -> None:
        nonlocal reloads
        expected = mem_views[reloads]
        assert view(red) == expected, f"step {reloads}: redis store differs from memory store"
        fresh = BufferLogic(RedisStore(server.url, prefix=store.prefix), groups_per_version=3, max_staleness=1)
        assert view(fresh) == expected, f"step {reloads}: state reloaded from Redis differs"
        reloads += 1

    scenario(red, check)
    final = mem_views[-1]["ledger"]
    assert final["trained"] == ["g0", "g3"]
    assert final["dropped"]["g1"] == "stale"
    assert set(final["dropped"].values()) == {"stale", "end_of_run"}
    # final groups leave the stream and its pending list; only bob's g2 and carol's g4 (unacked) remain
    assert final["held"] == [] and len(final["delivered"]) == 2
    assert store.r.xlen(store.k_stream) == 2
    assert store.r.xpending(store.k_stream, GROUP)["consumers"] == [{"name": b"bob", "pending": 1},
                                                                    {"name": b"carol", "pending": 1}]
    assert store.r.hlen(store.k_ids) == 2


def test_put_is_idempotent_at_the_script_level(store: RedisStore):
    """A put whose reply was lost is retried; the script must not add a second entry."""
    g = make_group("once").to_wire()
    args = [GROUP, HELD_CONSUMER, 1, "once", 0, 1, 5]
    keys = [store.k_stream, store.k_ids, store.k_meta]
    sid1 = store._put(keys, args)
    sid2 = store._put(keys, args)
    assert sid1 == sid2 and len(sid1) == 1
    assert store.r.xlen(store.k_stream) == 1
    assert store.r.xpending(store.k_stream, GROUP)["consumers"] == [{"name": HELD_CONSUMER.encode(), "pending": 1}]
    assert g["group_id"] == "once"


def test_pending_entries_carry_owner_and_idle_time(store: RedisStore, server: RedisServer):
    logic = BufferLogic(store, groups_per_version=10, max_staleness=5, visibility_timeout_s=0.2)
    for i in range(3):
        logic.put(make_group(f"g{i}").to_wire())
    logic.try_get(2, 0, "learner-7")
    pending = store.r.xpending_range(store.k_stream, GROUP, "-", "+", 10)
    assert sorted(p["consumer"].decode() for p in pending) == [HELD_CONSUMER, "learner-7", "learner-7"]
    time.sleep(0.3)
    # a service started now sees the delivery as overdue (idle time survives in Redis) and returns it
    fresh = BufferLogic(RedisStore(server.url, prefix=store.prefix), groups_per_version=10, max_staleness=5,
                        visibility_timeout_s=0.2)
    assert fresh.tick() == 2
    owners = {p["consumer"].decode() for p in store.r.xpending_range(store.k_stream, GROUP, "-", "+", 10)}
    assert owners == {HELD_CONSUMER}


def test_a_renewed_lease_restarts_the_idle_time_in_redis(store: RedisStore, server: RedisServer):
    """A learner's lease renewal (issue 31, defect 8) resets the pending entry's idle time: a service started
    after it does not see the delivery as overdue."""
    logic = BufferLogic(store, groups_per_version=10, max_staleness=5, visibility_timeout_s=0.4)
    for i in range(2):
        logic.put(make_group(f"g{i}").to_wire())
    logic.try_get(2, 0, "learner-7")
    time.sleep(0.3)
    assert logic.renew("learner-7", ["g0", "g1", "nope"]) == {"renewed": 2, "lost": ["nope"]}
    time.sleep(0.2)  # 0.5 s since the delivery, 0.2 s since the renewal
    fresh = BufferLogic(RedisStore(server.url, prefix=store.prefix), groups_per_version=10, max_staleness=5,
                        visibility_timeout_s=0.4)
    assert fresh.tick() == 0
    assert sorted(fresh.store.delivered()) == ["g0", "g1"]


def test_url_carries_the_password(server: RedisServer):
    assert isinstance(make_store("redis", url=server.url, prefix="t:pw"), RedisStore)
    wrong = server.url.replace("s3cret", "nope")
    with pytest.raises(redis.AuthenticationError):
        RedisStore(wrong, prefix="t:pw", retry_s=0.5)
    with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
        RedisStore(server.url.replace(":s3cret@", ""), prefix="t:pw", retry_s=0.5)
