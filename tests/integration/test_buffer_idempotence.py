"""Retries are safe: a put of a known id is a counted duplicate in every state; a retried admit grants once."""

from __future__ import annotations

import pytest

from async_rlhf.buffer.client import BufferClient, BufferUnavailable, encode_group
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.buffer.testing import make_group


def test_put_of_a_known_id_is_a_duplicate_in_every_state():
    logic = BufferLogic(MemoryStore(), groups_per_version=10, max_staleness=0)
    for gid in ("held", "awaiting", "delivered", "trained", "dropped"):
        logic.put(make_group(gid).to_wire(), rewards_pending=gid == "awaiting")
    logic.try_get(3, 0, "l")  # delivers held, delivered, trained (fifo; awaiting is skipped)
    logic.ack(["trained"])
    logic.store.redeliver(["held"])
    logic.store.drop(["dropped"], "stale")
    states = {gid: logic.store.state(gid) for gid in ("held", "awaiting", "delivered", "trained", "dropped")}
    assert states == {"held": "held", "awaiting": "awaiting_reward", "delivered": "delivered",
                      "trained": "trained", "dropped": "dropped"}
    before = logic.stats(ledger=True)["ledger"]
    for gid in states:
        assert logic.put(make_group(gid).to_wire()) == {"accepted": False, "duplicate": True}, gid
        assert logic.put(encode_group(make_group(gid)), rewards_pending=True)["duplicate"] is True, gid
    assert logic.put_many([encode_group(make_group("new")), encode_group(make_group("new")),
                           encode_group(make_group("trained"))]) == ["ok", "duplicate", "duplicate"]
    assert logic.counters["duplicates"] == 12 and logic.counters["put"] == 6
    after = logic.stats(ledger=True)["ledger"]
    assert after == before | {"held": ["held", "new"]}  # nothing else moved, nothing stored twice
    assert logic.admission.accepted == 6


def test_batched_put_with_a_malformed_group_stores_nothing():
    logic = BufferLogic(MemoryStore(), groups_per_version=10, max_staleness=0)
    with pytest.raises(ValueError, match="group 1 of the put is not msgpack"):
        logic.put_many([encode_group(make_group("a")), b"\xc1garbage"])
    assert logic.store.state("a") is None and logic.counters["put"] == 0


@pytest.fixture
def service():
    logic = BufferLogic(MemoryStore(), groups_per_version=4, max_staleness=0)
    svc = BufferService(logic).start()
    try:
        yield svc
    finally:
        svc.stop()


def test_admit_retried_after_a_lost_reply_grants_once(service: BufferService):
    c = BufferClient(service.address, timeout_s=0.3)
    try:
        with service._lock:  # the service is stuck: the admit is received but its answer comes too late
            with pytest.raises(BufferUnavailable):
                c.admit(3)
        granted, _ = c.admit(3)  # the retry repeats the request id
        assert granted == 3
        assert c.stats()["buffer/running"] == 3, "the retried admit granted slots twice"
        assert c.stats()["buffer/admit_retried"] == 1
        granted, _ = c.admit(3)  # a new admit is a new request
        assert granted == 1 and c.stats()["buffer/running"] == 4
    finally:
        c.close()


def test_retry_that_wants_fewer_gives_the_rest_back(service: BufferService):
    c = BufferClient(service.address, timeout_s=0.3)
    try:
        with service._lock:
            with pytest.raises(BufferUnavailable):
                c.admit(3)
        assert c.admit(1)[0] == 1
        assert c.stats()["buffer/running"] == 1
    finally:
        c.close()


def test_put_retried_after_a_lost_reply_is_stored_once(service: BufferService):
    c = BufferClient(service.address, timeout_s=0.3)
    try:
        with service._lock:
            with pytest.raises(BufferUnavailable):
                c.put(make_group("g"))
        assert c.put(make_group("g")) is False  # the first put landed: the retry is a duplicate
        s = c.stats(ledger=True)
        assert s["ledger"]["held"] == ["g"] and s["buffer/put"] == 1 and s["buffer/duplicates"] == 1
    finally:
        c.close()


def test_admit_answers_survive_a_restart_on_redis(tmp_path, monkeypatch: pytest.MonkeyPatch):
    from async_rlhf.buffer import logic as logic_module
    from async_rlhf.buffer.redis_store import RedisStore
    from async_rlhf.buffer.testing import RedisServer

    monkeypatch.setattr(logic_module, "ADMIT_MEMORY", 50)

    with RedisServer(tmp_path) as srv:
        store = RedisStore(srv.url, prefix="admits")
        first = BufferLogic(store, groups_per_version=4, max_staleness=0)
        assert first.admit(3, "req-1")["granted"] == 3
        assert first.admit(0, "req-0")["granted"] == 0
        for i in range(80):  # only the last ADMIT_MEMORY grants are remembered
            first.admission.running = 0
            first.admit(1, f"filler-{i}")
        assert store.r.hlen(store.k_admits) == 50 and store.r.llen(store.k_admit_order) == 50
        first.admission.running = 0
        assert first.admit(2, "req-2")["granted"] == 2
        first.store.save_meta(first._meta())
        restarted = BufferLogic(RedisStore(srv.url, prefix="admits"), groups_per_version=4, max_staleness=0)
        assert restarted.admission.running == 2
        assert restarted.admit(2, "req-2") == {"granted": 2, "version": 0}  # the killed service's answer
        assert restarted.admission.running == 2, "a retried admit granted twice after a restart"
        assert list(restarted._admits)[-1] == "req-2" and "filler-79" in restarted._admits
        assert "req-1" not in restarted._admits
