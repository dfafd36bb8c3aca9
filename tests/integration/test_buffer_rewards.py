"""Late rewards: a group put with rewards pending waits (never delivered) until reward() or its deadline.

Each scenario runs on the memory store and on a Redis store (a private redis-server), and the Redis one is
reloaded into a fresh service to check that awaiting groups survive a restart.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest

from async_rlhf.buffer.client import BufferClient, BufferRequestError
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.redis_store import AWAITING_CONSUMER, GROUP, RedisStore
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.buffer.testing import RedisServer, make_group
from async_rlhf.wire import WireError


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(params=["memory", "redis"])
def new_logic(request: pytest.FixtureRequest):
    """A factory of BufferLogic on one store; for Redis every call reloads the same prefix."""
    prefix = f"rw:{request.node.name}"
    if request.param == "redis":
        srv = request.getfixturevalue("server")
        RedisStore(srv.url, prefix=prefix).wipe()

    def make(**kw) -> BufferLogic:
        store = MemoryStore() if request.param == "memory" else RedisStore(srv.url, prefix=prefix)
        return BufferLogic(store, **{"groups_per_version": 8, "max_staleness": 1, **kw})

    return make


def rewards_of(data: bytes) -> list[float]:
    return [s["reward"] for s in msgpack.unpackb(data)["samples"]]


def test_awaiting_group_is_never_delivered_until_rewarded(new_logic):
    logic = new_logic()
    assert logic.admit(2)["granted"] == 2
    assert logic.put(make_group("late", samples=3).to_wire(), rewards_pending=True)["accepted"] is True
    assert logic.put(make_group("now").to_wire())["accepted"] is True
    s = logic.stats(ledger=True)
    assert s["buffer/awaiting_reward"] == 1 and s["buffer/depth"] == 1
    assert s["ledger"]["awaiting_reward"] == ["late"] and s["ledger"]["held"] == ["now"]
    assert logic.admission.accepted == 2 and logic.admission.running == 0  # awaiting counts as accepted
    assert logic.try_get(2, 0) is None  # only "now" is deliverable
    assert logic.reward("late", [1.0, 0.5, 0.25]) == {"ok": True}
    got = logic.try_get(2, 0)
    assert [msgpack.unpackb(g)["group_id"] for g in got] == ["now", "late"]  # rewarded: queued as of now
    assert rewards_of(got[1]) == [1.0, 0.5, 0.25]
    assert logic.stats()["buffer/awaiting_reward"] == 0 and logic.counters["rewarded"] == 1


def test_reward_refusals_are_answered_and_counted(new_logic):
    logic = new_logic()
    logic.put(make_group("a", samples=2).to_wire(), rewards_pending=True)
    logic.put(make_group("b").to_wire())
    assert logic.reward("nope", [1.0]) == {"ok": False, "reason": "unknown_group", "state": None}
    assert logic.reward("b", [1.0])["reason"] == "already_rewarded"
    with pytest.raises(WireError, match="2 samples but 3 rewards"):
        logic.reward("a", [1.0, 2.0, 3.0])
    with pytest.raises(WireError, match="finite numbers"):
        logic.reward("a", [1.0, float("nan")])
    assert logic.store.state("a") == "awaiting_reward"  # a refused reward changes nothing
    assert logic.reward("a", [1, 0])["ok"] is True
    assert logic.reward("a", [1, 0])["reason"] == "already_rewarded"  # a repeat is harmless
    logic.try_get(2, 0, "l")
    logic.ack(["a", "b"])
    assert logic.reward("a", [1, 0])["reason"] == "finished"
    c = logic.counters
    assert (c["reward_refused_unknown_group"], c["reward_refused_already_rewarded"],
            c["reward_refused_finished"]) == (1, 2, 1)


def test_reward_deadline_drops_and_releases_the_slot(new_logic):
    logic = new_logic(reward_deadline_s=5.0, groups_per_version=2, max_staleness=0)
    assert logic.admit(5)["granted"] == 2
    logic.put(make_group("slow").to_wire(), rewards_pending=True)
    logic.put(make_group("fast").to_wire(), rewards_pending=True)
    assert logic.admit(1)["granted"] == 0  # both slots taken while awaiting
    t_put = logic.store.awaiting()["slow"].since
    logic.reward("fast", [1.0])
    logic.tick(now=t_put + 4.0)
    assert logic.store.state("slow") == "awaiting_reward"
    logic.tick(now=t_put + 6.0)
    s = logic.stats(ledger=True)
    assert s["ledger"]["dropped"] == {"slow": "reward_timeout"}
    assert s["buffer/dropped_reward_timeout"] == 1 and s["buffer/awaiting_reward"] == 0
    assert logic.admit(1)["granted"] == 1  # the slot came back
    assert logic.reward("slow", [1.0])["reason"] == "finished"
    assert logic.put(make_group("slow").to_wire())["duplicate"] is True  # a dropped id stays dropped


@pytest.mark.parametrize("new_logic", ["redis"], indirect=True)  # the memory store keeps nothing across one
def test_awaiting_groups_survive_a_restart(new_logic):
    logic = new_logic()
    logic.put(make_group("w1", samples=2).to_wire(), rewards_pending=True)
    logic.put(make_group("w2").to_wire(), rewards_pending=True)
    logic.reward("w2", [0.5])
    since = logic.store.awaiting()["w1"].since
    store = logic.store
    assert isinstance(store, RedisStore)
    pending = store.r.xpending_range(store.k_stream, GROUP, "-", "+", 10)
    assert sorted(p["consumer"].decode() for p in pending) == [AWAITING_CONSUMER, "_held"]
    assert store.r.xlen(store.k_stream) == 2  # the rewarded copy replaced its awaiting entry
    again = new_logic()
    assert again.stats(ledger=True)["ledger"] == logic.stats(ledger=True)["ledger"]
    assert abs(again.store.awaiting()["w1"].since - since) < 1.0  # the deadline keeps counting
    assert rewards_of(again.store.get_held("w2").data) == [0.5]
    assert again.reward("w1", [2.0, 3.0])["ok"] is True
    assert [rewards_of(g) for g in again.try_get(2, 0)] == [[0.5], [2.0, 3.0]]
    third = new_logic()
    assert third.stats()["buffer/delivered_unacked"] == 2 and third.stats()["buffer/awaiting_reward"] == 0


def test_client_reward_round_trip():
    logic = BufferLogic(MemoryStore(), groups_per_version=8, max_staleness=1)
    svc = BufferService(logic).start()
    c = BufferClient(svc.address, timeout_s=5.0)
    try:
        assert c.put(make_group("g", samples=2), rewards_pending=True) is True
        assert c.get(1, 0, wait_s=0.05) == []
        with pytest.raises(BufferRequestError, match="one reward per sample"):
            c.reward("g", [1.0])
        assert c.reward("missing", [1.0])["reason"] == "unknown_group"
        assert c.reward("g", [1.0, 0.0])["ok"] is True
        (got,) = c.get(1, 0, wait_s=1.0)
        assert [s.reward for s in got.samples] == [1.0, 0.0]
        s = c.stats()
        assert s["buffer/reward_refused_unknown_group"] == 1 and s["buffer/reject_malformed"] == 1
    finally:
        c.close()
        svc.stop()


def test_end_of_run_drops_awaiting_groups_too(new_logic):
    logic = new_logic()
    logic.put(make_group("held").to_wire())
    logic.put(make_group("waiting").to_wire(), rewards_pending=True)
    assert logic.drop_held("unconsumed_at_shutdown") == 2
    led = logic.stats(ledger=True)["ledger"]
    assert led["dropped"] == {"held": "unconsumed_at_shutdown", "waiting": "unconsumed_at_shutdown"}
    assert led["awaiting_reward"] == [] and led["held"] == []
