"""Sampling policies, the capacity bound, redelivery and metrics of BufferLogic (memory store)."""

import msgpack
import pytest

from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.metrics import LatencyWindow, RateMeter
from async_rlhf.buffer.policy import POLICIES, check_policy
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.buffer.testing import make_group


def wire(gid: str, version: int = 0) -> dict:
    return make_group(gid, version).to_wire()


def logic(policy="fifo", capacity=0, max_staleness=10, visibility=600.0) -> BufferLogic:
    return BufferLogic(MemoryStore(), groups_per_version=100, max_staleness=max_staleness, capacity=capacity,
                       policy=policy, visibility_timeout_s=visibility)


def ids(groups: list[bytes]) -> list[str]:
    return [msgpack.unpackb(g)["group_id"] for g in groups]


def test_fifo_and_freshest_order():
    for policy, want in (("fifo", ["a", "b", "c"]), ("freshest", ["c", "b", "a"])):
        lg = logic(policy)
        lg.put(wire("a", 1))
        lg.put(wire("b", 2))
        lg.put(wire("c", 3))
        lg.put(wire("d", 1))
        assert ids(lg.try_get(3, 3)) == want, policy
    lg = logic("freshest")
    for gid, v in (("x", 2), ("y", 2), ("z", 1)):
        lg.put(wire(gid, v))
    assert ids(lg.try_get(3, 2)) == ["x", "y", "z"]  # equal versions keep arrival order


def test_unknown_policy_is_refused():
    assert set(POLICIES) == {"fifo", "freshest", "evict_stale"}
    with pytest.raises(ValueError, match="buffer.policy"):
        check_policy("lifo")
    with pytest.raises(ValueError, match="capacity"):
        logic(capacity=-1)


def test_capacity_pushes_back_on_admission_and_put():
    lg = logic(capacity=3)
    assert lg.admit(5)["granted"] == 3
    assert lg.admit(1)["granted"] == 0  # three running fill the buffer
    for gid in "abc":
        assert lg.put(wire(gid))["accepted"] is True
    assert lg.admit(1)["granted"] == 0  # three held
    assert lg.put(wire("d")) == {"accepted": False, "duplicate": False, "full": True}
    assert len(lg.store) == 3 and lg.store.state("d") is None
    assert ids(lg.try_get(2, 0, "l")) == ["a", "b"]
    assert lg.admit(1)["granted"] == 0  # delivered but unacked still occupy memory
    lg.ack(["a", "b"])
    assert lg.admit(5)["granted"] == 2
    s = lg.stats()
    assert s["buffer/put_full"] == 1 and s["buffer/admit_full"] >= 3 and s["buffer/capacity_groups"] == 3


def test_evict_stale_makes_room_for_fresher_groups():
    lg = logic("evict_stale", capacity=2)
    lg.put(wire("old", 0))
    lg.put(wire("mid", 1))
    assert lg.put(wire("same", 0))["full"] is True  # not fresher than the oldest held: refused
    assert lg.put(wire("new", 2))["accepted"] is True
    assert lg.store.dropped() == {"old": "evicted"}
    assert [g.group_id for g in lg.store.peek_all()] == ["mid", "new"]
    assert lg.counters["dropped_evicted"] == 1
    assert lg.admission.accepted == 2


def test_visibility_timeout_redelivers_and_late_ack_counts_once():
    lg = logic(visibility=5.0)
    for gid in "abc":
        lg.put(wire(gid))
    assert ids(lg.try_get(2, 0, "dead")) == ["a", "b"]
    t_delivered = lg.store.delivered()["a"].at
    assert lg.tick(now=t_delivered + 4.0) == 0
    assert lg.tick(now=t_delivered + 6.0) == 2
    assert lg.store.delivered() == {}
    assert ids(lg.try_get(3, 0, "alive")) == ["a", "b", "c"]  # the returned ones keep their place
    assert lg.counters["redelivered"] == 2
    assert lg.ack(["a", "b", "c"]) == {"acked": 3}
    assert lg.ack(["a"]) == {"acked": 0}  # the dead learner's late ack: already trained
    assert lg.store.trained() == {"a", "b", "c"}
    assert lg.counters["duplicate_ack"] == 1


def test_late_ack_of_a_group_held_again_is_accepted_once():
    lg = logic()
    lg.put(wire("a"))
    lg.put(wire("never"))
    lg.try_get(1, 0, "slow")
    assert lg.declare_dead("slow") == 1
    assert lg.ack(["a", "never"]) == {"acked": 1}  # slow learner was alive after all; "never" was never delivered
    assert lg.store.trained() == {"a"} and [g.group_id for g in lg.store.peek_all()] == ["never"]
    assert lg.try_get(1, 0, "other") is not None
    assert lg.stats()["buffer/unknown_ack"] == 1


def test_declare_dead_only_returns_that_consumers_groups():
    lg = logic()
    for gid in "abcd":
        lg.put(wire(gid))
    lg.try_get(2, 0, "one")
    lg.try_get(1, 0, "two")
    assert lg.release(0, consumer="one") == {"redelivered": 2}
    assert set(lg.store.delivered()) == {"c"}
    assert lg.counters["returned_consumer_dead"] == 2


def test_redelivered_group_that_went_stale_is_dropped():
    lg = logic(max_staleness=0)
    lg.put(wire("a", 0))
    lg.try_get(1, 0, "dead")
    lg.set_version(1)
    lg.declare_dead("dead")
    assert lg.try_get(1, 1, "next") is None
    assert lg.store.dropped() == {"a": "stale"}


def test_metrics_rates_and_latency():
    rate = RateMeter(window_s=10)
    for t in range(20):
        rate.add(5, now=1000.0 + t)
    assert rate.rate(now=1019.5) == pytest.approx(5.0, rel=0.1)
    assert rate.rate(now=1100.0) == 0.0
    win = LatencyWindow(size=100)
    for i in range(1, 101):
        win.add(i / 1000)
    p50, p99 = win.percentiles(0.5, 0.99)
    assert p50 == pytest.approx(51.0) and p99 == pytest.approx(100.0)
    lg = logic()
    lg.put(wire("a"))
    lg.record_latency("put", 0.002)
    lg.record_latency("get", 0.004)
    s = lg.stats()
    assert s["buffer/put_per_s"] > 0
    assert s["buffer/latency_put_p50_ms"] == pytest.approx(2.0)
    assert s["buffer/latency_p99_ms"] == pytest.approx(4.0)
    assert s["buffer/depth"] == 1 and s["buffer/delivered_unacked"] == 0
