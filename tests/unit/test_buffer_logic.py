"""BufferLogic with a MemoryStore, driven directly: validation, idempotence, FIFO, staleness, ledger."""

import msgpack
import numpy as np
import pytest

from async_rlhf.buffer.client import decode_group
from async_rlhf.buffer.service import BufferLogic
from async_rlhf.buffer.store import MemoryStore, StoredGroup
from async_rlhf.types import Group, Sample
from async_rlhf.wire import WireError


def make_group(gid: str, versions=(0, 0), n: int = 2) -> Group:
    samples = []
    for i in range(n):
        v = np.asarray(versions, np.int32)
        samples.append(Sample(np.arange(len(v), dtype=np.int32) + 10 * i, np.full(len(v), -0.5, np.float32), v,
                              float(i % 2)))
    return Group(gid, np.array([1, 2, 3], np.int32), samples, generator=0, meta={"k": gid})


def wire(gid: str, versions=(0, 0), n: int = 2) -> dict:
    return make_group(gid, versions, n).to_wire()


def new_logic(groups_per_version=4, max_staleness=1) -> BufferLogic:
    return BufferLogic(MemoryStore(), groups_per_version=groups_per_version, max_staleness=max_staleness)


def ids(groups: list[bytes]) -> list[str]:
    return [msgpack.unpackb(g)["group_id"] for g in groups]


def ledger(logic: BufferLogic) -> dict:
    return logic.stats(ledger=True)["ledger"]


def assert_partition(logic: BufferLogic, all_ids: set[str]) -> None:
    led = ledger(logic)
    sets = [set(led["held"]), set(led["delivered"]), set(led["trained"]), set(led["dropped"])]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not sets[i] & sets[j], f"ledger sets {i} and {j} overlap: {sets[i] & sets[j]}"
    assert set().union(*sets) == all_ids
    assert sum(len(s) for s in sets) == len(all_ids)


def test_put_validates():
    logic = new_logic()
    bad = wire("g0")
    bad["samples"][0]["logprobs"]["data"] = b"\x00"  # wrong byte count
    with pytest.raises(WireError) as info:
        logic.put(bad)
    assert info.value.reason == "malformed"
    with pytest.raises(WireError):
        logic.put(None)
    with pytest.raises(WireError):
        logic.put({"group_id": "x"})
    assert len(logic.store) == 0
    assert logic.counters["put"] == 0
    assert logic.admission.accepted == 0


def test_put_records_metadata():
    logic = new_logic()
    assert logic.put(wire("g0", versions=(3, 4, 4), n=3)) == {"accepted": True, "duplicate": False}
    (stored,) = logic.store.peek_all()
    assert stored.group_id == "g0"
    assert stored.min_version == 3
    assert stored.num_samples == 3
    assert stored.num_tokens == 9
    assert logic.counters["put_tokens"] == 9
    assert logic.admission.accepted == 1


def test_duplicate_put_is_not_stored_twice():
    logic = new_logic()
    assert logic.admit(4)["granted"] == 4
    assert logic.put(wire("g0"))["accepted"] is True
    assert logic.put(wire("g0")) == {"accepted": False, "duplicate": True}
    assert len(logic.store) == 1
    assert logic.counters["duplicates"] == 1
    assert logic.counters["put"] == 1
    assert (logic.admission.accepted, logic.admission.running) == (1, 3)
    # still a duplicate once delivered, and once trained
    assert ids(logic.try_get(1, 0)) == ["g0"]
    assert logic.put(wire("g0"))["duplicate"] is True
    logic.ack(["g0"])
    assert logic.put(wire("g0"))["duplicate"] is True
    assert len(logic.store) == 0
    assert logic.counters["duplicates"] == 3
    assert logic.admission.accepted == 1


def test_try_get_waits_for_n_then_fifo():
    logic = new_logic(groups_per_version=8)
    assert logic.try_get(3, 0) is None
    for gid in ("a", "b"):
        logic.put(wire(gid))
    assert logic.try_get(3, 0) is None
    assert len(logic.store) == 2  # nothing taken by a failed get
    for gid in ("c", "d", "e"):
        logic.put(wire(gid))
    got = logic.try_get(3, 0)
    assert ids(got) == ["a", "b", "c"]
    first = msgpack.unpackb(got[0])
    assert first == wire("a") | {"t_start": first["t_start"], "t_end": first["t_end"]}
    assert logic.try_get(3, 0) is None
    assert ids(logic.try_get(2, 0)) == ["d", "e"]
    assert logic.counters["delivered"] == 5
    assert {g: d.version for g, d in logic.store.delivered().items()} == {gid: 0 for gid in "abcde"}


def test_delivered_group_round_trips_through_from_wire():
    logic = new_logic()
    g = make_group("g7", versions=(1, 2))
    logic.put(g.to_wire())
    (w,) = logic.try_get(1, 2)
    back = decode_group(w)
    assert back.group_id == "g7" and back.min_version == 1
    np.testing.assert_array_equal(back.samples[1].completion_ids, [10, 11])
    assert logic.stats()["staleness/hist"] == {"1": 1}


def test_stale_groups_are_dropped_counted_and_free_admission():
    logic = new_logic(groups_per_version=2, max_staleness=1)
    assert logic.admit(10)["granted"] == 4
    logic.put(wire("old", versions=(0, 1)))   # oldest token v0
    logic.put(wire("mid", versions=(1, 1)))
    logic.put(wire("new", versions=(2, 2)))
    assert logic.admission.accepted == 3
    logic.set_version(2)
    # at learner version 2 with max_staleness 1: v0 is 2 behind (stale), v1 and v2 are fine
    got = logic.try_get(1, 2)
    assert ids(got) == ["mid"]
    assert logic.store.dropped() == {"old": "stale"}
    assert logic.counters["dropped_stale"] == 1
    assert logic.admission.accepted == 2
    s = logic.stats()
    assert s["buffer/dropped_stale"] == 1
    assert s["buffer/depth"] == 1
    # a stale drop gave its slot back: capacity (1+2+1)*2 = 8, accepted 2, running 4 - 3 = 1
    assert logic.admission.running == 1
    assert logic.admit(10)["granted"] == 5
    # v3: "new" (v2) is still fresh
    assert ids(logic.try_get(1, 3)) == ["new"]
    assert logic.counters["dropped_stale"] == 1


def test_try_get_returns_none_when_drops_leave_too_few():
    logic = new_logic(groups_per_version=4, max_staleness=0)
    logic.put(wire("a", versions=(0,)))
    logic.put(wire("b", versions=(1,)))
    assert logic.try_get(2, 1) is None
    assert logic.store.dropped() == {"a": "stale"}
    assert [g.group_id for g in logic.store.peek_all()] == ["b"]


def test_ack_moves_delivered_to_trained():
    logic = new_logic()
    for gid in ("a", "b", "c"):
        logic.put(wire(gid))
    logic.try_get(2, 0)
    assert logic.ack(["a"]) == {"acked": 1}
    assert logic.store.trained() == {"a"}
    assert set(logic.store.delivered()) == {"b"}
    assert logic.ack(["a", "b", "zzz", "c"]) == {"acked": 1}
    assert logic.store.trained() == {"a", "b"}
    assert logic.store.delivered() == {}
    assert logic.counters["duplicate_ack"] == 1
    assert logic.counters["unknown_ack"] == 2  # "zzz" never existed, "c" was never delivered
    assert logic.counters["trained"] == 2
    assert [g.group_id for g in logic.store.peek_all()] == ["c"]
    s = logic.stats()
    assert s["buffer/duplicate_ack"] == 1 and s["buffer/unknown_ack"] == 2 and s["buffer/trained"] == 2


def test_ledger_partitions_every_put_id_through_a_scenario():
    logic = new_logic(groups_per_version=2, max_staleness=0)
    put: set[str] = set()

    def put_group(gid, version):
        logic.put(wire(gid, versions=(version, version)))
        put.add(gid)
        assert_partition(logic, put)

    assert logic.admit(5)["granted"] == 2
    put_group("a", 0)
    put_group("b", 0)
    put_group("b", 0)  # duplicate
    assert logic.try_get(2, 0) is not None
    assert_partition(logic, put)
    logic.set_version(1)
    put_group("c", 0)          # generated at v0, arrives after v1 went live: stale at v1
    put_group("d", 1)
    logic.ack(["a"])
    assert_partition(logic, put)
    assert logic.try_get(2, 1) is None  # drops "c", only "d" left
    assert_partition(logic, put)
    put_group("e", 1)
    put_group("c", 1)                   # re-put of a dropped id stays dropped
    got = logic.try_get(2, 1)
    assert ids(got) == ["d", "e"]
    assert_partition(logic, put)
    logic.ack(["b", "d", "e", "e", "nope"])
    assert_partition(logic, put)
    led = ledger(logic)
    assert led == {"held": [], "awaiting_reward": [], "delivered": [], "trained": ["a", "b", "d", "e"],
                   "dropped": {"c": "stale"}}
    assert logic.counters["duplicates"] == 2
    assert logic.counters["duplicate_ack"] == 1
    assert logic.counters["unknown_ack"] == 1
    s = logic.stats()
    assert s["buffer/delivered_unacked"] == 0
    assert s["buffer/put"] == 5
    assert s["buffer/accepted"] == 4  # five put, one dropped


def test_admit_release_and_version_through_logic():
    logic = new_logic(groups_per_version=3, max_staleness=0)
    assert logic.admit(5) == {"granted": 3, "version": 0}
    logic.release(2)
    assert logic.admit(5) == {"granted": 2, "version": 0}
    assert logic.counters["admitted"] == 5
    assert logic.set_version(2) == {"version": 2}
    with pytest.raises(ValueError):
        logic.set_version(1)
    s = logic.stats()
    assert s["buffer/version"] == 2 and s["buffer/capacity"] == 9 and s["buffer/running"] == 3


def test_memory_store_basics():
    store = MemoryStore()
    g = [StoredGroup(str(i), 0, 1, 1, b"") for i in range(4)]
    assert all(store.put(x) for x in g)
    assert store.put(StoredGroup("1", 5, 1, 1, b"")) is False
    assert [x.min_version for x in store.peek_all()] == [0, 0, 0, 0]
    assert store.drop(["2", "missing"], "test") == ["2"]
    assert [x.group_id for x in store.deliver(["0", "1"], "L", 0)] == ["0", "1"]
    assert len(store) == 1 and store.state("0") == "delivered" and store.dropped() == {"2": "test"}
